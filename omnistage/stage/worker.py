"""``ArenaWorker``: what one rank of a stage owns — its arena, the modules adopted into it, and
the sleep controller over them — for every stage kind.

A kind's worker builds its modules into the arena (``_build``) and says how a weight source is
copied in (``load_weights``) and what the live weights are called (``weight_targets``); the
arena's lifecycle (created here unless given, closed on a failed build and on ``close``) and
sleep, wake and weight updates are the same for all. The engine above drives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.invariant_linear import install as install_invariant_linear
from omnistage.stage.control import Ack
from omnistage.stage.sleep_control import SleepController


class ArenaWorker:
    def __init__(
        self,
        config: StageConfig,
        *,
        arena: Arena | None = None,
        rank: int = 0,
        load_weights: bool = True,
    ) -> None:
        # A request's GEMM rows must not depend on its batch (omnistage/batch_invariance.py).
        install_invariant_linear()
        self.config = config
        self.rank = rank
        self._owns_arena = arena is None
        self.arena = arena if arena is not None else Arena(config.device)
        try:
            self._build(config, load_weights)
        except BaseException:
            if self._owns_arena:  # nothing else frees device memory mapped by a failed build
                self.arena.close()
            raise
        self.sleep_control = SleepController(
            self.arena, config.stage_id, self.checkpoint, self.load_weights, rank=rank
        )

    # -- the kind's part ------------------------------------------------------------------

    def _build(self, config: StageConfig, load_weights: bool) -> None:
        """Build the modules into ``self.arena`` (and load the checkpoint if ``load_weights``)."""
        raise NotImplementedError

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> Any:
        """Copy a weight source into the live weights in place (``CheckpointError`` if it
        does not fit; missing tensors only with ``strict``); returns the bytes copied or a
        report carrying ``num_bytes``."""
        raise NotImplementedError

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by the names a weight source (a trainer's state dict) uses."""
        raise NotImplementedError

    @property
    def checkpoint(self) -> Path:
        """Where the weights come from: what a level-2 reload replays first."""
        return Path(self.config.model)

    # -- memory and weights ---------------------------------------------------------------

    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: Any) -> Ack:
        return self.sleep_control.sleep(level, tags, **metadata)

    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack:
        return self.sleep_control.wake_up(tags, reload)

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        return self.sleep_control.update_weights(path, check_finite=check_finite)

    def adopt_history(self, sources: list[str], *, load: bool) -> None:
        self.sleep_control.adopt_history(sources, load=load)

    def close(self) -> None:
        if self._owns_arena:
            self.arena.close()
