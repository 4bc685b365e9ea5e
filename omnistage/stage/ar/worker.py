"""``ARWorker``: what one rank of an AR stage owns — its arena, the model runner (weights and
KV cache in that arena) and the sleep controller over it.

The engine (scheduler, sampler, requests) runs once per stage and drives its workers: today
one, in-process; a tensor-parallel stage has one per rank, each in its own process, and every
control operation reaches all of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import module_targets
from omnistage.models.tensor_parallel import SINGLE, TPGroup
from omnistage.stage.ar.kv_cache import KV_CACHE_TAG
from omnistage.stage.ar.model_runner import ModelRunner, StepResult
from omnistage.stage.ar.sequence import Sequence
from omnistage.stage.messages import Ack
from omnistage.stage.sleep_control import SleepController


class ARWorker:
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
        self._owns_arena = arena is None
        self.arena = arena if arena is not None else Arena(config.device)
        try:
            self.runner = ModelRunner(
                config, model_config, self.arena, load_weights=load_weights, tp=tp
            )
        except BaseException:
            if self._owns_arena:
                self.arena.close()
            raise
        self.rank = rank
        self.sleep_control = SleepController(
            self.arena, config.stage_id, config.model, self.runner.load_weights, rank=rank
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def has_cuda_graphs(self) -> bool:
        return self.runner.has_cuda_graphs

    def execute(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        return self.runner.run(seqs, is_prefill)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        return self.runner.embed_tokens(token_ids)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (what a trainer's state dict names them)."""
        return module_targets(self.runner.model)

    def copy_kv_block(self, src: int, dst: int) -> None:
        self.runner.copy_kv_block(src, dst)

    def sleep(self, level: int, tags: Seq[str] | None, **metadata: object) -> Ack:
        return self.sleep_control.sleep(level, tags, **metadata)

    def wake_up(self, tags: Seq[str] | None, reload: bool) -> Ack:
        """Memory back (weights reloaded unless ``reload`` is False); a KV cache that comes
        back holds garbage, which nothing reads: the engine resets its block bookkeeping."""
        kv_was_asleep = self.arena.is_asleep(KV_CACHE_TAG)
        ack = self.sleep_control.wake_up(tags, reload)
        kv_woke = kv_was_asleep and not self.arena.is_asleep(KV_CACHE_TAG)
        if kv_woke and self.runner.device.type != "cpu":  # fresh host pages are zero already
            self.runner.kv_cache.clear()
        # The weights and KV cache are back at the addresses the graphs were captured with.
        ack.metadata.cuda_graph_recalled = self.has_cuda_graphs and ack.status == "SUCCESS"
        return ack

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        return self.sleep_control.update_weights(path, check_finite=check_finite)

    def adopt_history(self, sources: list[str], *, load: bool) -> None:
        self.sleep_control.adopt_history(sources, load=load)

    def close(self) -> None:
        if self._owns_arena:
            self.arena.close()
