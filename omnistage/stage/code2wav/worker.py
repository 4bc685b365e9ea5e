"""``Code2WavWorker``: what a code2wav stage's rank owns — its arena, the token2wav modules
adopted into it, the voices, and the sleep controller over the weights. The engine (queue,
interleaved ODE steps) drives it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.tiny import ensure_preset
from omnistage.stage.code2wav.pipeline import Token2WavPipeline
from omnistage.stage.messages import Ack
from omnistage.stage.sleep_control import SleepController

logger = logging.getLogger(__name__)

MODEL_STAGE = "code2wav"


class Code2WavWorker:
    def __init__(self, config: StageConfig, *, rank: int = 0, load_weights: bool = True) -> None:
        if config.model_stage not in (None, MODEL_STAGE):
            raise ValueError(
                f"a code2wav stage runs model_stage {MODEL_STAGE!r}, got {config.model_stage!r}"
            )
        if config.dtype not in ("auto", "float32"):
            logger.warning(
                "stage %d: code2wav runs in float32 (as transformers' token2wav); dtype %s "
                "is ignored",
                config.stage_id,
                config.dtype,
            )
        folder = Path(config.model)
        if config.preset is not None and not (folder / "config.json").is_file():
            ensure_preset(config.preset, folder)
        self.arena = Arena(config.device)
        try:
            self.pipeline = Token2WavPipeline(folder, self.arena, load=load_weights)
        except BaseException:
            self.arena.close()  # nothing else frees device memory mapped by a failed build
            raise
        self.sleep_control = SleepController(
            self.arena, config.stage_id, folder, self.pipeline.load_weights, rank=rank
        )

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``token2wav.<module>.<tensor>``)."""
        return self.pipeline.weight_targets()

    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: object) -> Ack:
        return self.sleep_control.sleep(level, tags, **metadata)

    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack:
        return self.sleep_control.wake_up(tags, reload)

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        return self.sleep_control.update_weights(path, check_finite=check_finite)

    def close(self) -> None:
        self.arena.close()
