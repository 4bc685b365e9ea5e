"""What ``AsyncOmni.generate`` yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.stage.messages import TokenLogprobs


@dataclass
class OmniImage:
    png: bytes
    width: int
    height: int
    seed: int | None = None


@dataclass
class OmniRequestOutput:
    """One update of a request: a text delta from an AR stage, or a finished stage's result.

    ``final`` is True on the last output of the whole request (all stages and all samples
    done, or ended early by abort/error); ``finished`` when this stage is done with this
    sample (``index``).
    """

    request_id: str
    stage_id: int
    modality: str  # "text" or "image"
    index: int = 0  # which of the request's ``n`` samples
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # this stage is done with the request
    final: bool = False
    finish_reason: str | None = None
    images: list[OmniImage] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one entry per token of the delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, on a sample's first
    extra: dict[str, Any] = field(default_factory=dict)
