"""Input processors: turn stage k's finished output into stage k+1's request.

The pipeline config names one per stage (``input_processor``); each takes the upstream
``StageResult`` and the user's original request options and returns the wire request for
the next stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageResult:
    """A stage's finished output for one request, as the next stage's processor sees it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    payload: dict[str, Any] = field(default_factory=dict)


InputProcessor = Callable[[StageResult, dict[str, Any]], dict[str, Any]]


def thinker_hidden_to_image_cond(upstream: StageResult, options: dict[str, Any]) -> dict[str, Any]:
    """Condition an image decoder on the thinker's final hidden states (one row per token)."""
    hidden = upstream.payload.get("hidden_states")
    if hidden is None:
        raise ValueError("upstream AR stage returned no hidden_states; it must be asked for them")
    return {"prompt_embeds": hidden, "params": dict(options.get("image_params") or {})}


def text_to_image_prompt(upstream: StageResult, options: dict[str, Any]) -> dict[str, Any]:
    """Use the thinker's generated text as the image prompt of a text-conditioned decoder."""
    return {"prompt": upstream.text, "params": dict(options.get("image_params") or {})}


INPUT_PROCESSORS: dict[str, InputProcessor] = {
    "thinker_hidden_to_image_cond": thinker_hidden_to_image_cond,
    "text_to_image_prompt": text_to_image_prompt,
}

# Which upstream payload each processor needs, so the upstream stage is asked to return it.
NEEDS_HIDDEN_STATES = frozenset({"thinker_hidden_to_image_cond"})


def get_input_processor(name: str) -> InputProcessor:
    try:
        return INPUT_PROCESSORS[name]
    except KeyError:
        raise ValueError(
            f"unknown input_processor {name!r}; known: {sorted(INPUT_PROCESSORS)}"
        ) from None
