"""What the omni families' vocoders (Qwen2.5-Omni's ``token2wav.Token2WavPipeline``,
Qwen3-Omni's ``code2wav.Code2WavVocoder``) share: their weights' checkpoint names under the
vocoder part's prefix and the copy of a weight source into the adopted tensors."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from omnistage.models.loader import load_into


class VocoderWeights:
    """A vocoder's weights: a family's sets ``part`` (the checkpoint prefix of its tensors,
    ``code2wav.``), ``names_hint`` (said when a name is unknown), ``_parts`` (its modules'
    prefixes, which a source saved without ``part`` starts with) and ``_derived`` (derived
    buffers' names: never read from a source), and says ``weight_targets``."""

    part: str
    names_hint: str
    _parts: tuple[str, ...]
    _derived: Collection[str]

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``part`` + the module's name)."""
        raise NotImplementedError

    def rename(self, name: str) -> str | None:
        """A source tensor's target name; None (not read) for other parts' tensors and for
        derived buffers a source may hold. Also takes names without ``part`` (a lone
        module's save)."""
        rest = name.removeprefix(self.part)
        if rest == name and not rest.startswith(self._parts):
            return None  # thinker.*, talker.*, anything not the vocoder's
        return None if rest in self._derived else self.part + rest

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        """Copy a weight source (the checkpoint folder, or a safetensors file or folder for
        ``update_weights``) into the adopted tensors in place. Every name and shape (and with
        ``check_finite`` every value) is checked before any byte is copied, so a bad source
        leaves the weights untouched. Unknown vocoder tensors raise ``CheckpointError``;
        missing ones only with ``strict``. Returns the bytes copied."""
        report = load_into(
            self.weight_targets(),
            path,
            rename=self.rename,
            strict=strict,
            check_finite=check_finite,
            hint=self.names_hint,
        )
        return report.num_bytes


class CodeStream:
    """The shared part of a vocoder's stream (one utterance spoken chunk by chunk): its
    ``codes`` so far, until ``end_input``; its samples, finished and kept until
    ``take_audio``."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.ended = False
        self._audio: list[torch.Tensor] = []

    def end_input(self) -> None:
        self.ended = True

    def take_audio(self) -> torch.Tensor | None:
        """The samples finished since the last call (1-D float32 on the CPU), or None."""
        if not self._audio:
            return None
        audio, self._audio = torch.cat(self._audio), []
        return audio
