"""Input processors: turn stage k's finished output into stage k+1's prompt.

The pipeline config names one per stage (``input_processor``); each takes the upstream
``StageResult`` and returns the prompt fields of the next stage's request (its kind's
preparer then adds the user's parameters and validates it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.errors import StageInternalError


@dataclass
class StageResult:
    """A stage's finished output for one request, as the next stage's processor sees it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None


InputProcessor = Callable[[StageResult], dict[str, Any]]


def thinker_hidden_to_image_cond(upstream: StageResult) -> dict[str, Any]:
    """Condition an image decoder on the thinker's final hidden states (one row per token)."""
    if upstream.hidden_states is None:
        raise StageInternalError("the upstream AR stage returned no hidden_states")
    return {"prompt_embeds": upstream.hidden_states}


def text_to_image_prompt(upstream: StageResult) -> dict[str, Any]:
    """Use the thinker's generated text as the image prompt of a text-conditioned decoder."""
    return {"prompt": upstream.text}


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
