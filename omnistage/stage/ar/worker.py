"""``ARWorker``: what one rank of an AR stage owns — its arena, the model runner (weights and
KV cache in that arena) and the sleep controller over it (``ArenaWorker``).

The engine (scheduler, sampler, requests) runs once per stage and drives its workers: one,
in-process; a tensor-parallel stage has one per rank, each in its own process, and every
control operation reaches all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import LoadReport, module_targets
from omnistage.models.tensor_parallel import SINGLE, TPGroup
from omnistage.stage.ar.model_runner import ModelRunner, StepResult
from omnistage.stage.ar.sequence import SequenceState
from omnistage.stage.control import Ack
from omnistage.stage.vocabulary import KV_CACHE
from omnistage.stage.worker import ArenaWorker


class ARWorker(ArenaWorker):
    def __init__(
        self,
        config: StageConfig,
        model_config: ARModelConfig,
        *,
        arena: Arena | None = None,
        rank: int = 0,
        load_weights: bool = True,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.model_config = model_config
        self.tp = tp
        super().__init__(config, arena=arena, rank=rank, load_weights=load_weights)

    def _build(self, config: StageConfig, load_weights: bool) -> None:
        self.runner = ModelRunner(
            config, self.model_config, self.arena, load_weights=load_weights, tp=self.tp
        )

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> LoadReport:
        return self.runner.load_weights(Path(path), strict, check_finite)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (what a trainer's state dict names them)."""
        return module_targets(self.runner.model)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def has_cuda_graphs(self) -> bool:
        return self.runner.has_cuda_graphs

    def execute(self, seqs: list[SequenceState], is_prefill: bool) -> StepResult:
        return self.runner.run(seqs, is_prefill)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        return self.runner.embed_tokens(token_ids)

    def predict_frames(
        self,
        last_hidden: torch.Tensor,
        token_ids: list[int],
        seqs: list[SequenceState],
        generators: list[torch.Generator],
    ) -> list[list[int]]:
        return self.runner.predict_frames(last_hidden, token_ids, seqs, generators)

    def copy_kv_block(self, src: int, dst: int) -> None:
        self.runner.copy_kv_block(src, dst)

    def clear_encoder_cache(self) -> None:
        self.runner.encoder_cache.clear()

    def encoder_cache_status(self) -> dict[str, int]:
        return self.runner.encoder_cache.status()

    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: Any) -> Ack:
        if level >= 1:  # cached encoder outputs are memory a sleep releases too
            self.clear_encoder_cache()
        return super().sleep(level, tags, **metadata)

    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack:
        """Memory back (weights reloaded unless ``reload`` is False); a KV cache that comes
        back holds garbage, which nothing reads: the engine resets its block bookkeeping."""
        kv_was_asleep = self.arena.is_asleep(KV_CACHE)
        ack = super().wake_up(tags, reload)
        kv_woke = kv_was_asleep and not self.arena.is_asleep(KV_CACHE)
        if kv_woke and self.runner.device.type != "cpu":  # fresh host pages are zero already
            self.runner.kv_cache.clear()
        # The weights and KV cache are back at the addresses the graphs were captured with.
        ack.metadata.cuda_graph_recalled = self.has_cuda_graphs and ack.status == "SUCCESS"
        return ack
