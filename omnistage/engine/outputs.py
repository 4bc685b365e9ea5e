"""What ``AsyncOmni.generate`` yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.stage.media import OmniAudio, OmniImage
from omnistage.stage.messages import TokenLogprobs

__all__ = ["OmniAudio", "OmniImage", "OmniRequestOutput"]


@dataclass
class OmniRequestOutput:
    """One update of a request: a text delta from a token stage, or a finished stage's result.

    ``final`` is True on the last output of the whole request (all stages and all samples
    done, or ended early by abort/error); ``finished`` when this stage is done with this
    sample (``index``). ``media`` holds what a media stage produced (``OmniImage``,
    ``OmniAudio``); ``images`` and ``audio`` pick them by type, ``audio_delta`` the pieces of
    a stage that streams its speech.
    """

    request_id: str
    stage_id: int
    modality: str  # "text", "image" or "audio"
    index: int = 0  # which of the request's ``n`` samples
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # this stage is done with the request
    final: bool = False
    finish_reason: str | None = None
    media: list[Any] = field(default_factory=list)
    # A stage that streams its media (speech chunk by chunk): this update's piece. The last
    # update carries its last piece here and the whole in ``media``.
    media_delta: list[Any] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (on a text stage's)
    logprobs: list[TokenLogprobs] | None = None  # one entry per token of the delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, on a sample's first
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def images(self) -> list[OmniImage]:
        return [m for m in self.media if isinstance(m, OmniImage)]

    @property
    def audio(self) -> list[OmniAudio]:
        return [m for m in self.media if isinstance(m, OmniAudio)]

    @property
    def audio_delta(self) -> list[OmniAudio]:
        return [m for m in self.media_delta if isinstance(m, OmniAudio)]
