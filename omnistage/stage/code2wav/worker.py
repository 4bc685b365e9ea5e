"""``Code2WavWorker``: what a code2wav stage's rank owns — its arena, the vocoder its model
family builds into it (modules and voices), and the sleep controller over the weights
(``ArenaWorker``). The engine (queue, interleaved synthesis steps) drives it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.errors import CheckpointError
from omnistage.models import registry
from omnistage.models.interfaces import supports_vocoder
from omnistage.models.tiny import ensure_preset
from omnistage.stage.code2wav.params import Code2WavLimits
from omnistage.stage.worker import ArenaWorker

logger = logging.getLogger(__name__)


class Code2WavWorker(ArenaWorker):
    def _build(self, config: StageConfig, load_weights: bool) -> None:
        if config.dtype not in ("auto", "float32"):
            logger.warning(
                "stage %d: code2wav runs in float32 (as its reference does); dtype %s is ignored",
                config.stage_id,
                config.dtype,
            )
        folder = Path(config.model)
        if config.preset is not None and not (folder / "config.json").is_file():
            ensure_preset(config.preset, folder)
        family = registry.family_of_folder(folder)
        if not supports_vocoder(family):
            raise CheckpointError(f"{folder}: a {family.name} model has no vocoder part")
        self.vocoder = family.vocoder(
            folder, self.arena, part=config.model_stage, load=load_weights
        )

    @property
    def limits(self) -> Code2WavLimits:
        v = self.vocoder
        return Code2WavLimits(
            voices=list(v.voices),
            default_voice=v.default_voice,
            codebook_size=v.codebook_size,
            max_codes=v.max_codes,
            sample_rate=v.sample_rate,
            codes_per_frame=int(getattr(v, "codes_per_frame", 1)),
        )

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        return int(self.vocoder.load_weights(path, strict, check_finite=check_finite))

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name."""
        return dict(self.vocoder.weight_targets())
