"""What a decoder model may run beside its decoder, as hooks ``CausalLM`` gives defaults for:
a prompt built from a ``prompt_spec`` (a speech talker's rows, embedded in the stage) and
components adopted into the stage's arena under their own tags (a voice-cloning talker's
encoders), each sleeping, waking and reloading with the stage. A family's model overrides
the ones it has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.errors import InvalidRequestError


class PartHooks:
    """The hooks, with what a model that has none of them does."""

    def embed_prompt_spec(
        self, spec: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A ``prompt_spec`` as ``(prompt_embeds, decode_embeds, context_ids)`` (a speech
        talker's; ``context_ids``: what the next stage takes before the generated ids)."""
        raise InvalidRequestError("prompt_spec", "this model builds no prompt from a spec")

    @property
    def component_tags(self) -> list[str]:
        """The arena tags of what the model runs beside its decoder (``adopt_components``)."""
        return []

    def adopt_components(self, arena: Any, folder: Path, *, load: bool) -> None:
        """Build what the model runs beside its decoder into ``arena`` under their own tags
        (a voice-cloning talker's encoders), filled from ``folder`` with ``load``; none here."""

    def load_components(self, path: Path, tags: list[str]) -> int:
        """Refill the components under ``tags`` from a weight source; returns the bytes."""
        return 0
