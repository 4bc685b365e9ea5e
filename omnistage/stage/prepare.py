"""Request preparation: what runs in the API process before a request reaches a stage.

Each stage kind has a preparer (named in ``omnistage.stage.kinds``) that turns a user's
prompt into that kind's wire request, validated against what the stage reported at start-up
(its ``StageInfo``): tokenized, length-checked, parameters checked. A stage's busy loop then
only ever sees requests that fit; its own checks stay as a second line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.errors import InvalidRequestError
from omnistage.stage.messages import StageRequest

PROMPT_FIELDS = (
    "prompt",
    "prompt_token_ids",
    "messages",
    "prompt_embeds",
    "negative_prompt",
    "negative_prompt_embeds",
    "codes",
    "token_embeds_from",
    "decode_embeds",
)


@dataclass(frozen=True)
class Wants:
    """What the next stage needs from a stage's finished output: its hidden states (plus
    each position's input embedding), the embeddings of some token ids."""

    hidden_states: bool = False
    hidden_states_with_embeddings: bool = False
    embed_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestOptions:
    """The per-kind parameters of one pipeline request, as the user gave them."""

    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    image_params: Mapping[str, Any] = field(default_factory=dict)
    talker_params: Mapping[str, Any] = field(default_factory=dict)  # a talker stage's sampling
    audio_params: Mapping[str, Any] = field(default_factory=dict)  # voice, seed, ... (code2wav)


class RequestPreparer(Protocol):
    def check_options(self, options: RequestOptions) -> None:
        """Validate the parameters this kind takes from ``options`` (before any stage runs)."""
        ...

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: Wants
    ) -> StageRequest:
        """The wire request for ``prompt`` (a mapping of ``PROMPT_FIELDS``); ``wants`` says
        what the next stage needs from this one (hidden states, token embeddings). Raises
        ``InvalidRequestError`` naming the offending field."""
        ...


def prompt_fields(prompt: Any) -> dict[str, Any]:
    """A user prompt (a string, or a mapping of ``PROMPT_FIELDS``) as a dict of fields."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(
            "prompt", f"must be a string or an object, got {type(prompt).__name__}"
        )
    unknown = sorted(set(prompt) - set(PROMPT_FIELDS))
    if unknown:
        raise InvalidRequestError(
            unknown[0], f"unknown prompt field; prompts take {list(PROMPT_FIELDS)}"
        )
    return {k: v for k, v in prompt.items() if v is not None}


def check_mapping(value: Any, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field, f"must be an object, got {type(value).__name__}")
    return value
