"""``DiffusionWorker``: what a diffusion stage's rank owns — its arena, the pipeline its model
family builds into it, and the sleep controller over the weights (``ArenaWorker``). The
engine (queue, batching, the denoising loop) drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.models import registry
from omnistage.models.tiny import ensure_preset
from omnistage.stage.resolve import resolve_stored_dtype
from omnistage.stage.worker import ArenaWorker


class DiffusionWorker(ArenaWorker):
    family: Any  # the folder's ``FAMILY`` (``registry.family_of_folder``)
    pipeline: Any  # what its ``build`` returned: modules, scheduler config, tokenizers

    def _build(self, config: StageConfig, load_weights: bool) -> None:
        folder = Path(config.model)
        if config.preset is not None and not (folder / "model_index.json").is_file():
            ensure_preset(config.preset, folder)
        dtype = resolve_stored_dtype(config, folder).dtype
        self.family = registry.family_of_folder(folder)
        self.pipeline = self.family.build(folder, self.arena, dtype, load=load_weights)

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        return int(self.pipeline.load_weights(path, strict, check_finite=check_finite))

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by '<component>.<tensor>' name (the single-file update names)."""
        return dict(self.pipeline.weight_targets())
