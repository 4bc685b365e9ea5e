"""``DiffusionWorker``: what a diffusion stage's rank owns — its arena, the pipeline its model
family builds into it, and the sleep controller over the weights (``ArenaWorker``). The
engine (queue, batching, the denoising loop) drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.errors import CheckpointError
from omnistage.models import registry
from omnistage.models.diffusion.family import DiffusionFamily, is_diffusion_family
from omnistage.models.tiny import ensure_preset
from omnistage.stage.resolve import resolve_stored_dtype
from omnistage.stage.worker import ArenaWorker


class DiffusionWorker(ArenaWorker):
    family: DiffusionFamily  # the folder's ``FAMILY`` (``registry.family_of_folder``)
    pipeline: Any  # what its ``build`` returned: modules, scheduler config, tokenizers

    def _build(self, config: StageConfig, load_weights: bool) -> None:
        folder = Path(config.model)
        if config.preset is not None and not (folder / "model_index.json").is_file():
            ensure_preset(config.preset, folder)
        dtype = resolve_stored_dtype(config, folder).dtype
        family = registry.family_of_folder(folder)
        if not is_diffusion_family(family):
            raise CheckpointError(f"{folder}: a {family.name} model is not a diffusion pipeline")
        self.family = family
        self.pipeline = self.family.build(folder, self.arena, dtype, load=load_weights)

    def _writable_components(self) -> list[str]:
        """The components a weight source may write now: those whose tag is awake and,
        while some awake tag is invalid (a level-2 wake refilling it), only those — the
        components that kept serving are not rewritten. Components sleep apart only where
        the family adopts them under their own tags (``LoadedPipeline.tags``)."""
        tags = self.pipeline.tags
        awake = [n for n in self.pipeline.modules if not self.arena.is_asleep(tags[n])]
        invalid = [n for n in awake if not self.arena.is_valid(tags[n])]
        return invalid or awake

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        return int(
            self.pipeline.load_weights(
                path, strict, check_finite=check_finite, components=self._writable_components()
            )
        )

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by '<component>.<tensor>' name (the single-file update names),
        of the components a source may write now."""
        return dict(self.pipeline.weight_targets(self._writable_components()))
