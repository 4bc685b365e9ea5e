"""``OmniFamily``: the base of a multi-part omni checkpoint served as thinker → talker →
code2wav, each part a stage (its ``pipeline.yaml`` beside the family). What the families share
lives here — the pipeline template, the talker's request setup, the vocoder part's check,
speaking a given text (``omni_speech``) — and each family says the rest: its decoder parts'
configs, modules and renames, its prompt processor, its vocoder, its hand-offs
(``processors``), its speech prompt's system turn and voices (``speech``)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models.family import load_template
from omnistage.models.interfaces import (
    ARFamily,
    SupportsMultiModal,
    SupportsProcessors,
    SupportsSpeech,
    SupportsVocoder,
)

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    from omnistage.models.ar_config import ARModelConfig
    from omnistage.models.interfaces import SpeechInput
    from omnistage.models.media import PromptProcessor

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


class OmniFamily(ARFamily, SupportsMultiModal, SupportsVocoder, SupportsProcessors, SupportsSpeech):
    """``label``: the family's name for people (in errors); ``package``: its package, which
    holds its ``pipeline.yaml``, its hand-offs (``processors.THINKER_TO_TALKER`` and
    ``processors.TALKER_TO_CODE2WAV``: ``processors``, by short name), what the talker asks
    of its requests (``talker.request_setup``, a function of the folder: its voices and codec
    ids) and how it speaks a given text (``speech.SPEECH``, an ``OmniSpeech``). Where the rest of its code is (``module:name``, imported when first asked):
    ``prompt_processor_class`` (the thinker's prompt processor, built from the folder) and
    ``vocoder_class`` (the code2wav part's module, built from the folder and an arena)."""

    name: str
    label: str
    package: str
    prompt_processor_class: str
    vocoder_class: str

    def __init__(self) -> None:
        self.processors: Mapping[str, str] = {
            "thinker_to_talker": f"{self.package}.processors:THINKER_TO_TALKER",
            "talker_to_code2wav": f"{self.package}.processors:TALKER_TO_CODE2WAV",
        }
        self.talker_setup = f"{self.package}.talker:request_setup"
        self.speech = f"{self.package}.speech:SPEECH"

    def pipeline(self) -> list[dict[str, Any]]:
        return load_template(self.package, "pipeline.yaml")

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        if config.part != "talker":
            return {}
        setup: dict[str, Any] = _load(self.talker_setup)(folder)
        return setup

    def speech_prompt(
        self, folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
    ) -> dict[str, Any]:
        """The thinker's prompt for saying ``speech.text`` (``omni_speech``)."""
        prompt: dict[str, Any] = _load(self.speech).prompt(folder, encode, speech)
        return prompt

    def speech_voices(self, folder: str) -> list[str]:
        voices: list[str] = _load(self.speech).voices(folder)
        return voices

    def prompt_processor(self, folder: str | Path) -> PromptProcessor:
        """The thinker's prompt processor (placeholders, encoder inputs, positions)."""
        processor: PromptProcessor = _load(self.prompt_processor_class)(folder)
        return processor

    def vocoder(
        self, folder: str | Path, arena: Any, *, part: str | None = None, load: bool = True
    ) -> Any:
        """The code2wav part in ``arena``."""
        check_vocoder_part(self.label, part)
        return _load(self.vocoder_class)(folder, arena, load=load)


def check_vocoder_part(label: str, part: str | None) -> None:
    """A code2wav stage of a ``label`` checkpoint runs its vocoder part (else ``CheckpointError``)."""
    if part not in (None, VOCODER_PART):
        raise CheckpointError(
            f"model_stage: a {label} vocoder stage runs {VOCODER_PART!r}, got {part!r}"
        )


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
