"""``OmniFamily``: the base of a multi-part omni checkpoint served as thinker → talker →
code2wav, each part a stage (its ``pipeline.yaml`` beside the family). What the families share
lives here — the pipeline template, the talker's request setup, the vocoder part's check —
and each family says the rest: its decoder parts' configs, modules and renames, its prompt
processor, its vocoder, its hand-offs (``processors``)."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models.family import load_template
from omnistage.models.interfaces import (
    ARFamily,
    SupportsMultiModal,
    SupportsProcessors,
    SupportsVocoder,
)

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    from omnistage.models.ar_config import ARModelConfig

VOCODER_PART = "code2wav"


@dataclass(frozen=True)
class Checkpoint:
    """A family's checkpoint folders: ``config.json`` says ``model_type``; ``label`` is the
    family's name for people (in errors)."""

    model_type: str
    label: str

    def read_config(self, folder: str | Path) -> dict[str, Any] | None:
        """The folder's ``config.json`` if it is such a checkpoint, else None."""
        file = Path(folder) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(raw, dict) and raw.get("model_type") == self.model_type
        return raw if ok else None

    def config(
        self, folder: str | Path, error: type[Exception] = CheckpointError
    ) -> dict[str, Any]:
        """The folder's ``config.json`` (``error`` when it is not such a checkpoint)."""
        raw = self.read_config(folder)
        if raw is None:
            raise error(f"{folder} is not a {self.label} checkpoint")
        return raw


class OmniFamily(ARFamily, SupportsMultiModal, SupportsVocoder, SupportsProcessors):
    """``label``: the family's name for people (in errors); ``package``: where its
    ``pipeline.yaml`` is; ``processors``: its hand-offs by short name."""

    name: str
    label: str
    package: str
    processors: Mapping[str, str] = {}

    def pipeline(self) -> list[dict[str, Any]]:
        return load_template(self.package, "pipeline.yaml")

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        return self.talker_request_setup(folder) if config.part == "talker" else {}

    def vocoder(
        self, folder: str | Path, arena: Any, *, part: str | None = None, load: bool = True
    ) -> Any:
        """The code2wav part in ``arena``."""
        if part not in (None, VOCODER_PART):
            raise CheckpointError(
                f"model_stage: a {self.label} vocoder stage runs {VOCODER_PART!r}, got {part!r}"
            )
        return self.build_vocoder(folder, arena, load=load)

    @abstractmethod
    def talker_request_setup(self, folder: str) -> dict[str, Any]:
        """What the talker asks of its requests (its voices and codec ids)."""

    @abstractmethod
    def build_vocoder(self, folder: str | Path, arena: Any, *, load: bool) -> Any:
        """The code2wav part's module in ``arena``."""
