"""``DiffusionWorker``: what a diffusion stage's rank owns — its arena, the pipeline's modules
adopted into it, and the sleep controller over them. The engine (queue, batching, the
denoising loop) drives it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.loader import module_targets
from omnistage.models.tiny import ensure_preset
from omnistage.stage.diffusion.components import MODEL_INDEX
from omnistage.stage.diffusion.pipeline import ImagePipeline
from omnistage.stage.messages import Ack
from omnistage.stage.resolve import resolve_diffusion_stage
from omnistage.stage.sleep_control import SleepController


class DiffusionWorker:
    def __init__(self, config: StageConfig, *, rank: int = 0, load_weights: bool = True) -> None:
        folder = Path(config.model)
        if config.preset is not None and not (folder / MODEL_INDEX).is_file():
            ensure_preset(config.preset, folder)
        self.arena = Arena(config.device)
        try:
            dtype = resolve_diffusion_stage(config, folder).dtype
            self.pipeline = ImagePipeline(folder, self.arena, dtype, load=load_weights)
        except BaseException:
            self.arena.close()  # nothing else frees device memory mapped by a failed build
            raise
        self.sleep_control = SleepController(
            self.arena, config.stage_id, folder, self.pipeline.load_weights, rank=rank
        )

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by '<component>.<tensor>' name (the single-file update names)."""
        return {
            f"{name}.{key}": tensor
            for name, module in self.pipeline.modules.items()
            for key, tensor in module_targets(module).items()
        }

    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: object) -> Ack:
        return self.sleep_control.sleep(level, tags, **metadata)

    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack:
        return self.sleep_control.wake_up(tags, reload)

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        return self.sleep_control.update_weights(path, check_finite=check_finite)

    def close(self) -> None:
        self.arena.close()
