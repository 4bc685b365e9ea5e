"""What a stage engine hands back from ``step()``; shared by every engine kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omnistage.stage.messages import TokenLogprobs

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class StageOutput:
    """One update for one request: a streamed delta, or the final result when ``finished``.

    A finished request carries what a next stage needs from it in ``handoff`` (an AR stage's
    ``{"hidden_states": Tensor, "token_embeddings": Tensor}``, as its request asked) and the
    media a client gets in ``media`` (a diffusion stage's ``ImageOutput``, a code2wav
    stage's ``AudioOutput``).
    """

    request_id: str
    index: int = 0  # which of the request's samples (``n``) this output belongs to
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # set with finish_reason "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    handoff: dict[str, Any] | None = None
    media: list[Any] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one entry per new token, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first output
    # Seconds between the request's arrival at the stage and its first scheduling; set on
    # the first output of each request (the scheduler's wait, not the compute).
    queue_time_s: float | None = None
    # A streamed edge's input from this output (``Handoff``-shaped: the step's hidden-state
    # rows; the first output also the prompt's ids, token embeddings and positions).
    delta: dict[str, Any] | None = None
