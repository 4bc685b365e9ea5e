"""Tensor parallelism inside an AR stage: the stage process is rank 0, and it starts ranks
1..N-1 as processes of their own.

Every rank owns an ``ARWorker`` — its own arena, its slices of the weights (read straight from
the checkpoint files), the KV cache of its own kv heads and its own sleep controller — and the
ranks meet in a process group (gloo on the CPU, NCCL on CUDA) for the sums and gathers of the
forward pass. Everything else runs once, on rank 0: the scheduler, the sampler, the requests.

Rank 0 tells the others what to do over ZMQ (``RankGroup``): each step's batch (``SeqView``s:
what the model runner reads of a sequence), KV block copies, and control calls (sleep, wake,
weight updates), which every rank answers with its own ACK. ``TensorParallelWorker`` is rank 0's
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
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import zmq

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError, StageInternalError
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tensor_parallel import join_group
from omnistage.stage.ar.model_runner import StepResult
from omnistage.stage.ar.rank_main import follower_entry, rank_device
from omnistage.stage.ar.ray_ranks import ActorRank, current_placement, start_rank_actor
from omnistage.stage.ar.sequence import Sequence
from omnistage.stage.ar.worker import ARWorker
from omnistage.stage.messages import Ack
from omnistage.stage.startup import start_without_main, stop_process

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 600.0


@dataclass
class SeqView:
    """What the model runner reads of a sequence, for the ranks that do not schedule."""

    token_ids: list[int]
    num_tokens: int
    num_cached_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    has_input_embeds: bool
    hidden_states_with_embeddings: bool
    return_hidden_states: bool
    prompt_embeds: torch.Tensor | None = None
    token_embeds_from: int | None = None
    decode_embeds: torch.Tensor | None = None
    wants_prompt_logits: bool = False
    params: Any = field(default=None, repr=False)
    prompt_logprobs: Any = None

    def __post_init__(self) -> None:
        # The runner asks ``params.prompt_logprobs`` and ``prompt_logprobs`` for the same
        # decision rank 0 makes: computing prompt logits is a collective.
        self.params = SimpleNamespace(prompt_logprobs=0 if self.wants_prompt_logits else None)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @classmethod
    def of(cls, seq: Sequence, is_prefill: bool) -> SeqView:
        return cls(
            # A decode step reads only the last token; a prefill its tokens from the cache on.
            token_ids=list(seq.token_ids) if is_prefill else [seq.last_token_id],
            num_tokens=seq.num_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            block_table=list(seq.block_table),
            num_prompt_tokens=seq.num_prompt_tokens,
            has_input_embeds=seq.has_input_embeds,
            hidden_states_with_embeddings=seq.hidden_states_with_embeddings,
            return_hidden_states=seq.return_hidden_states,
            prompt_embeds=seq.prompt_embeds,
            token_embeds_from=seq.token_embeds_from,
            decode_embeds=seq.decode_embeds,
            wants_prompt_logits=is_prefill
            and seq.params.prompt_logprobs is not None
            and seq.prompt_logprobs is None,
        )


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
            kind, rank, value = self._receive(READY_TIMEOUT_S, "start")
            if kind == "failed":
                raise StageInternalError(f"rank {rank} of stage {self.stage_id}: {value}")
            blocks[rank] = value
        return [blocks[r] for r in range(1, self.size)]

    def send(self, *msg: object) -> None:
        data = pickle.dumps(msg)
        for out in self._outboxes:
            out.send(data)

    def call(self, method: str, **kwargs: Any) -> list[Ack]:
        """Every other rank's ACK for ``method`` (ranks 1..N-1, in order)."""
        self.send("call", method, kwargs)
        acks: dict[int, Ack] = {}
        while len(acks) < self.size - 1:
            kind, rank, value = self._receive(CALL_TIMEOUT_S, method)
            if kind == "ack":
                acks[rank] = value
        return [acks[r] for r in range(1, self.size)]

    def _receive(self, timeout_s: float, what: str) -> tuple[str, int, Any]:
        deadline = timeout_s * 1000
        while deadline > 0:
            if self._replies.poll(200):
                kind, rank, value = pickle.loads(self._replies.recv())
                return kind, rank, value
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
            self.send("shutdown")
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
        self.dead: str | None = None
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
    def arena(self) -> Arena:
        return self.local.arena

    @property
    def sleep_control(self) -> Any:
        return self.local.sleep_control

    @property
    def runner(self) -> Any:
        return self.local.runner

    @property
    def num_kv_blocks(self) -> int:
        return self.local.num_kv_blocks

    @property
    def has_cuda_graphs(self) -> bool:
        return False

    @property
    def rank_pids(self) -> list[int | None]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self.ranks.processes]

    def weight_targets(self) -> dict[str, torch.Tensor]:
        raise InvalidRequestError(
            "update_info",
            "weight sync into a tensor-parallel stage is not supported yet; load a checkpoint "
            "with update_weights (every rank reads its own slices)",
        )

    # -- every rank --------------------------------------------------------------------------

    def execute(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        self._check_alive()
        self.ranks.send("step", [SeqView.of(s, is_prefill) for s in seqs], is_prefill)
        return self.local.execute(seqs, is_prefill)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        self._check_alive()
        self.ranks.send("embed", list(token_ids))
        return self.local.embed_tokens(token_ids)

    def copy_kv_block(self, src: int, dst: int) -> None:
        self._check_alive()
        self.ranks.send("copy_kv", src, dst)
        self.local.copy_kv_block(src, dst)

    def sleep(self, level: int, tags: Seq[str] | None, **metadata: object) -> Ack:
        self._check_alive()
        local = self.local.sleep(level, tags, **metadata)
        others = self.ranks.call("sleep", level=level, tags=tags, **metadata)
        ack = _combined(local, others)
        if ack.status == "ERROR":  # undo it where it happened: the ranks stay alike
            self._undo([local, *others], "wake_up", tags=tags, reload=True)
            ack.metadata.sleeping_tags = self.local.sleep_control.sleeping_tags
        return ack

    def wake_up(self, tags: Seq[str] | None, reload: bool) -> Ack:
        self._check_alive()
        level = self.local.sleep_control.level
        local = self.local.wake_up(tags, reload)
        others = self.ranks.call("wake_up", tags=tags, reload=reload)
        ack = _combined(local, others)
        if ack.status == "ERROR":
            self._undo([local, *others], "sleep", level=level, tags=tags)
            ack.metadata.sleeping_tags = self.local.sleep_control.sleeping_tags
        return ack

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        self._check_alive()
        # Every rank checks before it copies: a bad file fails on rank 0 (raised, nothing
        # sent) and would fail alike on the others.
        local = self.local.update_weights(path, check_finite=check_finite)
        others = self.ranks.call("update_weights", path=str(path), check_finite=check_finite)
        return _combined(local, others)

    def adopt_history(self, sources: list[str], *, load: bool) -> None:
        self.local.adopt_history(sources, load=load)
        self.ranks.call("adopt_history", sources=sources, load=load)

    def _undo(self, acks: list[Ack], method: str, **kwargs: Any) -> None:
        done = [a.rank for a in acks if a.status == "SUCCESS"]
        if 0 in done:
            getattr(self.local, method)(**kwargs)
        if any(r != 0 for r in done):
            self.ranks.call(method, **kwargs)  # a no-op (SKIPPED) where nothing changed

    def close(self) -> None:
        self.ranks.close()
        self.local.close()


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
