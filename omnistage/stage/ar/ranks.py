"""Tensor parallelism inside an AR stage: the stage process is rank 0, and it starts ranks
1..N-1 as processes of their own.

Every rank owns an ``ARWorker`` — its own arena, its slices of the weights (read straight from
the checkpoint files), the KV cache of its own kv heads and its own sleep controller — and the
ranks meet in a process group (gloo on the CPU, NCCL on CUDA) for the sums and gathers of the
forward pass. Everything else runs once, on rank 0: the scheduler, the sampler, the requests.

Rank 0 tells the others what to do over ZMQ (``RankGroup``) in typed messages
(``rank_wire``): each step's batch (``SeqView``s: what the model runner reads of a sequence),
KV block copies, and control operations (sleep, wake, weight updates — the stage channel's own
structs), which every rank answers with its own ACK. ``TensorParallelWorker`` is rank 0's
``ARWorker`` as the engine sees it: it runs every call on all ranks and returns rank 0's ACK with
the others' in ``rank_acks``. A control call succeeds only if it succeeds on every rank; where
some ranks did it and others failed, it is undone on those that did, so the ranks never
disagree on what is asleep. A rank that dies ends the stage process (a collective would wait
for it forever): the server restarts the whole stage, every rank.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq

from omnistage.config import StageConfig
from omnistage.errors import StageInternalError
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tensor_parallel import join_group
from omnistage.stage import control as ops
from omnistage.stage.ar.model_runner import StepResult
from omnistage.stage.ar.rank_main import follower_entry, rank_device
from omnistage.stage.ar.rank_wire import (
    FromRank,
    RankControl,
    RankCopyKV,
    RankEmbed,
    RankFailed,
    RankReady,
    RankReply,
    RankShutdown,
    RankStep,
    RankSyncCommit,
    RankSyncPrepare,
    SeqView,
    ToRank,
    decode_from_rank,
    encode,
)
from omnistage.stage.ar.ray_ranks import ActorRank, current_placement, start_rank_actor
from omnistage.stage.ar.sequence import SequenceState
from omnistage.stage.ar.tp_weights import RankWeights, full_targets, slices_of
from omnistage.stage.ar.worker import ARWorker
from omnistage.stage.control import Ack
from omnistage.stage.startup import start_without_main, stop_process

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 600.0


# -- rank 0 --------------------------------------------------------------------------------


class RankGroup:
    """Ranks 1..N-1 of a stage, seen from rank 0: started, told, listened to, watched."""

    def __init__(
        self, config: StageConfig, size: int, *, num_threads: int, load_weights: bool
    ) -> None:
        self.size = size
        self.stage_id = config.stage_id
        self._dir = tempfile.mkdtemp(prefix=f"omnistage-stage{config.stage_id}-tp-")
        self.store = str(Path(self._dir) / "rendezvous")
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._outboxes: list[zmq.Socket[Any]] = []
        self.processes: list[Any] = []  # multiprocessing processes, or ``ActorRank``s
        self._closing = False
        on_ray = current_placement()  # rank 0 is a Ray actor: the others are actors too
        spawn = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, size):
                out = self._ctx.socket(zmq.PUSH)
                out.setsockopt(zmq.LINGER, 0)
                out.bind(f"ipc://{self._dir}/rank{rank}")
                self._outboxes.append(out)
                # Under Ray each rank's actor sees its own GPU as the stage's device.
                device = config.device if on_ray else rank_device(config.device, rank)
                args = (
                    config.model_copy(update={"device": device}).model_dump_json(),
                    rank, size, self.store,
                    f"ipc://{self._dir}/rank{rank}", f"ipc://{self._dir}/replies",
                    num_threads, load_weights,
                )  # fmt: skip
                name = f"omnistage-stage{config.stage_id}-rank{rank}"
                if on_ray is not None:
                    ray, group = on_ray
                    self.processes.append(
                        start_rank_actor(ray, group, rank, config.placement, name, args)
                    )
                    continue
                process = spawn.Process(target=follower_entry, args=args, name=name, daemon=True)
                start_without_main(process)
                self.processes.append(process)
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> list[int]:
        """Each other rank's KV blocks, once all are built (``StageInternalError`` if one
        cannot start)."""
        blocks: dict[int, int] = {}
        while len(blocks) < self.size - 1:
            msg = self._receive(READY_TIMEOUT_S, "start")
            if isinstance(msg, RankFailed):
                raise StageInternalError(f"rank {msg.rank} of stage {self.stage_id}: {msg.error}")
            if isinstance(msg, RankReady):
                blocks[msg.rank] = msg.num_kv_blocks
        return [blocks[r] for r in range(1, self.size)]

    def send(self, msg: ToRank) -> None:
        data = encode(msg)
        for out in self._outboxes:
            out.send(data)

    def call(self, op: ops.ControlOp | RankSyncPrepare | RankSyncCommit) -> list[Ack]:
        """Every other rank's ACK for ``op`` (ranks 1..N-1, in order); a rank's error is
        raised as its own class once every rank has answered."""
        self.send(op if isinstance(op, RankSyncPrepare | RankSyncCommit) else RankControl(op))
        replies: dict[int, RankReply] = {}
        while len(replies) < self.size - 1:
            msg = self._receive(CALL_TIMEOUT_S, type(op).__name__)
            if isinstance(msg, RankReply):
                replies[msg.rank] = msg
        failed = next((r for r in replies.values() if r.error is not None), None)
        if failed is not None and failed.error is not None:
            raise failed.error.rebuild(self.stage_id)
        return [ack for r in range(1, self.size) if (ack := replies[r].ack) is not None]

    def _receive(self, timeout_s: float, what: str) -> FromRank:
        deadline = timeout_s * 1000
        while deadline > 0:
            if self._replies.poll(200):
                return decode_from_rank(self._replies.recv())
            deadline -= 200
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise StageInternalError(
                    f"stage {self.stage_id}: rank process {dead[0].name} exited "
                    f"(code {dead[0].exitcode}) during {what}"
                )
        raise StageInternalError(f"stage {self.stage_id}: no answer from its ranks to {what}")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death`` (from a thread) when a rank process exits unasked."""

        def watch() -> None:
            # Polled (processes or Ray actors alike): twice a second costs nothing.
            while not self._closing and all(p.is_alive() for p in self.processes):
                time.sleep(0.5)
            dead = [p for p in self.processes if not p.is_alive()]
            if not self._closing and dead:
                on_death(f"{dead[0].name} (pid {dead[0].pid}) exited with code {dead[0].exitcode}")

        threading.Thread(target=watch, name=f"stage{self.stage_id}-ranks", daemon=True).start()

    def close(self) -> None:
        """Stop the other ranks (politely, then by force) and release the sockets."""
        self._closing = True
        with contextlib.suppress(zmq.ZMQError):
            self.send(RankShutdown())
        for process in self.processes:
            stop_process(process, 5.0)
            if isinstance(process, ActorRank):
                process.kill()  # an actor outlives its run(): end it
        for sock in [*self._outboxes, self._replies]:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def exit_stage_process(reason: str) -> None:
    """A rank died: end this stage process now, so the server restarts every rank."""
    logger.error("a tensor-parallel rank died: %s; ending the stage process", reason)
    os._exit(70)


def in_stage_process() -> bool:
    """True in a stage process (``proc.stage_main``), False in a user's (``LLM``)."""
    from omnistage.stage import proc

    return proc.IS_STAGE_PROCESS


class TensorParallelWorker:
    """Rank 0's ``ARWorker`` plus the other ranks, behind the ``ARWorker`` interface."""

    def __init__(
        self,
        config: StageConfig,
        model_config: ARModelConfig,
        *,
        arena: Arena | None = None,
        load_weights: bool = True,
        on_rank_death: Callable[[str], None] | None = None,
    ) -> None:
        """``on_rank_death(reason)``: what happens when a rank dies; by default a stage
        process ends (``exit_stage_process``) and an engine in a user's process fails every
        later call with ``StageInternalError``."""
        size = config.tensor_parallel_size
        threads = config.torch_threads or torch.get_num_threads()
        self.ranks = RankGroup(config, size, num_threads=threads, load_weights=load_weights)
        try:
            tp = join_group(self.ranks.store, 0, size, torch.device(config.device))
            self.local = ARWorker(
                config, model_config, arena=arena, load_weights=load_weights, tp=tp
            )
            others = self.ranks.wait_ready()
        except BaseException:
            self.ranks.close()
            raise
        if any(n != self.local.num_kv_blocks for n in others):
            self.close()
            raise StageInternalError(
                f"ranks planned different KV caches: {[self.local.num_kv_blocks, *others]} blocks"
            )
        # what the engine reads: rank 0's, fixed for the worker's life (no CUDA graphs here)
        self.arena: Arena = self.local.arena
        self.sleep_control = self.local.sleep_control
        self.runner = self.local.runner
        self.num_kv_blocks: int = self.local.num_kv_blocks
        self.has_cuda_graphs = False
        self.dead: str | None = None
        self._full: dict[str, torch.Tensor] | None = None
        self._synced = RankWeights(self.local)
        if on_rank_death is None:
            on_rank_death = exit_stage_process if in_stage_process() else self._mark_dead
        self.ranks.watch(on_rank_death)

    def _mark_dead(self, reason: str) -> None:
        logger.error("a tensor-parallel rank died: %s", reason)
        self.dead = reason

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise StageInternalError(f"a tensor-parallel rank died: {self.dead}")

    # -- what the engine reads -------------------------------------------------------------

    @property
    def rank_pids(self) -> list[int | None]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self.ranks.processes]

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The weights as a trainer holds them, whole (``meta``: shapes and dtypes only)."""
        if self._full is None:
            self._full = full_targets(self.local)
        return self._full

    def apply_synced(self, tensors: dict[str, torch.Tensor], version: str) -> Ack:
        """A trainer's checked whole tensors, staged in shared memory: every rank prepares
        its slices, then, all prepared, every rank applies them (``tp_weights``)."""
        self._check_alive()
        slices = slices_of(tensors)
        try:
            self.ranks.call(RankSyncPrepare(slices))
            self._synced.prepare(tensors)
        except BaseException:
            self._synced.commit(version, apply=False)
            self.ranks.call(RankSyncCommit(version, apply=False))
            raise
        local = self._synced.commit(version, apply=True)
        assert local is not None
        return _combined(local, self.ranks.call(RankSyncCommit(version, apply=True)))

    # -- every rank --------------------------------------------------------------------------

    def execute(self, seqs: list[SequenceState], is_prefill: bool) -> StepResult:
        self._check_alive()
        self.ranks.send(RankStep([SeqView.of(s, is_prefill) for s in seqs], is_prefill))
        return self.local.execute(seqs, is_prefill)

    def predict_frames(self, *args: Any) -> list[list[int]]:
        raise NotImplementedError("a model with several codebooks per step runs on one rank")

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        self._check_alive()
        self.ranks.send(RankEmbed(list(token_ids)))
        return self.local.embed_tokens(token_ids)

    def copy_kv_block(self, src: int, dst: int) -> None:
        self._check_alive()
        self.ranks.send(RankCopyKV(src, dst))
        self.local.copy_kv_block(src, dst)

    def clear_encoder_cache(self) -> None:
        # Rank 0's only: weights change on every rank together (each rank's load or synced
        # update clears its own).
        self.local.clear_encoder_cache()

    def encoder_cache_status(self) -> dict[str, int]:
        return self.local.encoder_cache_status()

    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: Any) -> Ack:
        self._check_alive()
        local = self.local.sleep(level, tags, **metadata)
        op = ops.Sleep(level=level, mode=metadata.get("mode") or "abort", tags=_listed(tags))
        others = self.ranks.call(op)
        done = _succeeded([local, *others])
        ack = _combined(local, others)
        if ack.status == "ERROR":  # undo it where it happened: the ranks stay alike
            self._undo(ack, done, ops.WakeUp(tags=_listed(tags), reload=True))
        return ack

    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack:
        self._check_alive()
        level = self.local.sleep_control.level
        local = self.local.wake_up(tags, reload)
        others = self.ranks.call(ops.WakeUp(tags=_listed(tags), reload=reload))
        done = _succeeded([local, *others])
        ack = _combined(local, others)
        if ack.status == "ERROR":
            self._undo(ack, done, ops.Sleep(level=max(level, 1), tags=_listed(tags)))
        return ack

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        self._check_alive()
        # Every rank checks before it copies: a bad file fails on rank 0 (raised, nothing
        # sent) and would fail alike on the others.
        local = self.local.update_weights(path, check_finite=check_finite)
        op = ops.UpdateWeights(path=str(path), check_finite=check_finite)
        return _combined(local, self.ranks.call(op))

    def adopt_history(self, sources: list[str], *, load: bool) -> None:
        self.local.adopt_history(sources, load=load)
        self.ranks.call(ops.AdoptHistory(sources=list(sources), load=load))

    def _undo(self, ack: Ack, done: list[int], op: ops.Sleep | ops.WakeUp) -> None:
        """Undo a transition on the ranks in ``done`` (where it succeeded; a no-op, SKIPPED,
        on the others), so that the ranks never disagree on what is asleep."""
        if 0 in done:
            if isinstance(op, ops.Sleep):
                self.local.sleep(op.level, op.tags, mode=op.mode)
            else:
                self.local.wake_up(op.tags, op.reload)
        if any(rank != 0 for rank in done):
            self.ranks.call(op)
        ack.metadata.sleeping_tags = self.local.sleep_control.sleeping_tags

    def close(self) -> None:
        self.ranks.close()
        self.local.close()


def _succeeded(acks: list[Ack]) -> list[int]:
    return [a.rank for a in acks if a.status == "SUCCESS"]


def _listed(tags: Sequence[str] | None) -> list[str] | None:
    return None if tags is None else list(tags)


def _combined(local: Ack, others: list[Ack]) -> Ack:
    """Rank 0's ACK for the whole stage: ERROR if any rank failed (naming each), the others'
    ACKs in ``rank_acks``."""
    failed = [a for a in [local, *others] if a.status == "ERROR"]
    local.rank_acks = others
    if failed:
        local.status = "ERROR"
        local.error_msg = "; ".join(f"rank {a.rank}: {a.error_msg}" for a in failed)
    return local


def make_worker(
    config: StageConfig, model_config: ARModelConfig, arena: Arena | None, load_weights: bool
) -> ARWorker | TensorParallelWorker:
    """The stage's worker: one ``ARWorker``, or every rank of a tensor-parallel stage."""
    if config.tensor_parallel_size > 1:
        return TensorParallelWorker(config, model_config, arena=arena, load_weights=load_weights)
    return ARWorker(config, model_config, arena=arena, load_weights=load_weights)
