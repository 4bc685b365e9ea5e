"""A stage of several processes (``replicas: N``): ``ReplicatedStageClient`` stands where a
``StageClient`` stands, so the router, the control plane and the supervisor see one client per
stage, and holds one ``StageClient`` per replica.

Placement. A request goes to the least-loaded replica that serves (awake, alive): the fewest
requests in flight there, ties taken in turn. An AR request whose prompt starts as an earlier
one's goes where that prefix was served — its KV blocks are cached there — unless that replica
has more than ``prefix_slack`` requests more in flight than the least-loaded one
(``PrefixPlacement``). A request stays on its replica for its life: its streamed input, its
abort and its hand-off all reach the replica it went to; what it hands the next stage is read
by whichever replica of that stage takes it (shared memory on one host, the producer's socket
across hosts), and a hand-off nobody takes is discarded by every replica (only its producer
holds it; the others find nothing).

Control. A control call reaches every replica (or those of ``replica_ids``) at once; their ACKs
come back flat, replica by replica, each stamped with its ``replica_id``, and the first ACK is
one whose status is the stage's: ``ERROR`` if any replica's is, else ``SUCCESS`` if any, else
``SKIPPED`` — as rank 0's ACK stands for a stage's ranks. A replica that sleeps stops taking
requests before its sleep starts; one that wakes takes them again.

Death. A replica that dies fails its own requests (its ``StageClient`` does); while another
replica lives, the stage serves on and the replica listeners (the supervisor) restart that one.
When the last one dies the stage is dead as a one-process stage is, and ``restart`` brings back
every replica that is down.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from omnistage import errors
from omnistage.engine.stage_client import StageClient
from omnistage.stage import control as ops
from omnistage.stage.control import Ack, make_ack
from omnistage.stage.messages import (
    HandoffRef,
    OutputMessage,
    StageInfo,
    StageRequest,
    StartupOptions,
    Upstream,
)

logger = logging.getLogger(__name__)

AWAKE, ASLEEP, DRAINING, DEAD = "awake", "asleep", "draining", "dead"


class PrefixPlacement:
    """Where prompts' prefixes were last served: keys are hashes of a prompt's first
    ``block * 2**k`` token ids (k = 0, 1, ...), so prompts sharing a long head share the keys
    up to its length; the longest known key names the replica. Bounded (``max_keys``, least
    recently used dropped)."""

    def __init__(self, block: int = 16, max_keys: int = 65536) -> None:
        self.block = block
        self.max_keys = max_keys
        self._where: OrderedDict[bytes, int] = OrderedDict()

    def _keys(self, token_ids: Sequence[int]) -> list[bytes]:
        keys, digest, done, length = [], hashlib.blake2b(digest_size=16), 0, self.block
        while length <= len(token_ids):
            digest.update(msgspec.msgpack.encode(list(token_ids[done:length])))
            keys.append(digest.copy().digest())
            done, length = length, length * 2
        return keys

    def lookup(self, token_ids: Sequence[int]) -> int | None:
        for key in reversed(self._keys(token_ids)):
            replica = self._where.get(key)
            if replica is not None:
                self._where.move_to_end(key)
                return replica
        return None

    def record(self, token_ids: Sequence[int], replica: int) -> None:
        for key in self._keys(token_ids):
            self._where[key] = replica
            self._where.move_to_end(key)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica whose cache is gone (slept, restarted): none of its prefixes holds."""
        for key in [k for k, r in self._where.items() if r == replica]:
            del self._where[key]


ReplicaDeath = Callable[[int, int], bool]


class ReplicatedStageClient:
    """One stage, ``len(replicas)`` processes (see the module docstring)."""

    prefix_slack = 4  # requests more in flight than the least-loaded that still win a prefix

    def __init__(self, replicas: Sequence[StageClient]) -> None:
        if not replicas:
            raise ValueError("a replicated stage needs at least one replica")
        self.replicas = list(replicas)
        self.config = replicas[0].config
        self.stage_id = self.config.stage_id
        self.kind: str = self.config.kind
        self.states = [AWAKE] * len(self.replicas)
        self.levels: list[int | None] = [None] * len(self.replicas)
        self._placed: dict[str, int] = {}
        self._turn = itertools.count()
        self._prefixes = PrefixPlacement()
        self._death_callbacks: list[Callable[[int], bool]] = []
        self._replica_death_callbacks: list[ReplicaDeath] = []
        self.restarting: set[int] = set()  # replicas the supervisor is bringing back alone
        self._sessions: dict[str, list[str]] = {}  # a transfer's session -> each replica's
        for index, replica in enumerate(self.replicas):
            replica.on_death(functools.partial(self._replica_died_at, index))

    # -- the stage as a whole ---------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _first_alive(self) -> StageClient:
        return next((r for r in self.replicas if not r.is_dead), self.replicas[0])

    @property
    def info(self) -> StageInfo | None:
        return self._first_alive().info

    @property
    def is_dead(self) -> bool:
        return all(r.is_dead for r in self.replicas)

    @property
    def death_reason(self) -> str:
        reasons = [f"replica {i}: {r.death_reason}" for i, r in enumerate(self.replicas)]
        return "; ".join(reasons) if self.is_dead else ""

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def pid(self) -> int | None:
        return self._first_alive().pid

    @property
    def exit_code(self) -> int | None:
        return self._first_alive().exit_code

    def replica_state(self, index: int) -> str:
        return DEAD if self.replicas[index].is_dead else self.states[index]

    def start(self, options: StartupOptions | None = None) -> None:
        for replica in self.replicas:
            replica.start(options)

    def wait_ready(self) -> None:
        for replica in self.replicas:
            replica.wait_ready()

    def attach(self) -> None:
        for replica in self.replicas:
            replica.attach()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def on_death(self, callback: Callable[[int], bool]) -> None:
        """``callback(stage_id)`` when the stage's last live replica dies."""
        self._death_callbacks.append(callback)

    def on_replica_death(self, callback: ReplicaDeath) -> None:
        """``callback(stage_id, replica_id)`` when a replica dies while another lives; it
        answers whether that replica comes back."""
        self._replica_death_callbacks.append(callback)

    def _replica_died_at(self, index: int, _stage_id: int) -> bool:
        return self._replica_died(index)

    def _replica_died(self, index: int) -> bool:
        self._prefixes.forget(index)
        others = [r for i, r in enumerate(self.replicas) if i != index and not r.is_dead]
        if others:
            comes_back = [cb(self.stage_id, index) for cb in self._replica_death_callbacks]
            return any(comes_back)
        return any([cb(self.stage_id) for cb in self._death_callbacks])

    async def restart(self, options: StartupOptions) -> None:
        """Every replica that is down (and not being restarted on its own), started again."""
        down = [i for i, r in enumerate(self.replicas) if r.is_dead and i not in self.restarting]
        await asyncio.gather(*(self.restart_replica(i, options) for i in down))

    async def restart_replica(self, index: int, options: StartupOptions) -> None:
        await self.replicas[index].restart(options)
        self.levels[index] = options.sleep_level
        self.states[index] = AWAKE if options.sleep_level is None else ASLEEP

    # -- placement ----------------------------------------------------------------------------

    def serving(self) -> list[int]:
        """The replicas that take new requests: alive and awake."""
        return [i for i, r in enumerate(self.replicas) if not r.is_dead and self.states[i] == AWAKE]

    def _choose(self, request: StageRequest) -> int:
        candidates = self.serving() or [i for i, r in enumerate(self.replicas) if not r.is_dead]
        if not candidates:
            raise errors.StageDeadError(self.stage_id, self.death_reason or "no replica is up")
        loads = {i: self.replicas[i].num_in_flight for i in candidates}
        least = min(loads.values())
        token_ids = getattr(request, "prompt_token_ids", None)
        if token_ids:
            cached = self._prefixes.lookup(token_ids)
            if cached in loads and loads[cached] <= least + self.prefix_slack:
                return cached
        idle = [i for i in candidates if loads[i] == least]
        return idle[next(self._turn) % len(idle)]

    def add_request(
        self,
        request_id: str,
        request: StageRequest,
        *,
        forward: bool = False,
        upstream: Upstream | None = None,
        stream: str | None = None,
        params: dict[str, dict[str, Any]] | None = None,
    ) -> asyncio.Queue[OutputMessage]:
        index = self._choose(request)
        queue = self.replicas[index].add_request(
            request_id, request, forward=forward, upstream=upstream, stream=stream, params=params
        )
        if len(self._placed) > 4 * 4096:  # the finished ones' entries, dropped now and then
            self._placed = {rid: i for rid, i in self._placed.items() if self._in_flight(i, rid)}
        self._placed[request_id] = index
        token_ids = getattr(request, "prompt_token_ids", None)
        if token_ids and self.kind == "ar":
            self._prefixes.record(token_ids, index)
        return queue

    def _in_flight(self, index: int, request_id: str) -> bool:
        return request_id in self.replicas[index]._queues

    def placed(self, request_id: str) -> int | None:
        """The replica a request went to (None: none, or it is long finished)."""
        return self._placed.get(request_id)

    def append_input(
        self, request_id: str, token_ids: list[int], final: bool, delta: Any = None
    ) -> None:
        index = self._placed.get(request_id)
        if index is not None:
            self.replicas[index].append_input(request_id, token_ids, final, delta)

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._placed.pop(request_id, None)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort(ids)

    def discard(self, ref: HandoffRef) -> None:
        for replica in self.replicas:
            if not replica.is_dead:
                replica.discard(ref)

    # -- control ------------------------------------------------------------------------------

    def _targets(self, replica_ids: Sequence[int] | None) -> list[int]:
        if replica_ids is None:
            return list(range(len(self.replicas)))
        return sorted(set(replica_ids))

    async def call(self, op: ops.ControlOp, replica_ids: Sequence[int] | None = None) -> Any:
        """``op`` on every replica of ``replica_ids`` (None: all) at once: ACKs flat (see the
        module docstring), a status with each replica's, or the first replica's value."""
        targets = self._targets(replica_ids)
        if isinstance(op, (*_TRANSFER_OPS, ops.WeightsChecksum)):
            return await self._transfer(op)
        if isinstance(op, ops.Status):
            return await self._status(targets)
        if isinstance(op, ops.Sleep):
            for index in targets:  # no request goes to a replica that is going to sleep
                if self.states[index] == AWAKE:
                    self.states[index] = DRAINING
        live = [i for i in targets if not self.replicas[i].is_dead]
        results = await asyncio.gather(
            *(self.replicas[i].call(op) for i in live), return_exceptions=True
        )
        answered = dict(zip(live, results, strict=True))
        if isinstance(op, ops.Sleep | ops.WakeUp):
            self._settle(op, answered)
        if not _acks_op(op):
            for result in answered.values():
                if isinstance(result, BaseException):
                    raise result
            if not answered:
                raise errors.StageDeadError(self.stage_id, "no replica is up")
            return next(iter(answered.values()))
        if not answered or all(isinstance(r, errors.StageDeadError) for r in answered.values()):
            first = next(iter(answered.values()), None)
            raise (
                first
                if isinstance(first, BaseException)
                else errors.StageDeadError(self.stage_id, "no replica is up")
            )
        acks: list[Ack] = []
        for index in targets:
            result = answered.get(index)
            if result is None:
                result = errors.StageDeadError(self.stage_id, self.replicas[index].death_reason)
            acks += [msgspec.structs.replace(a, replica_id=index) for a in _as_acks(self, result)]
        return rolled_up(acks)

    # -- a trainer's weight transfer: every replica takes the same tensors -----------------

    async def _transfer(self, op: ops.ControlOp) -> Any:
        """A weight-transfer step on every replica at once (a collective: each replica's
        rank 0 is a member of the trainer's group, replica ``r`` at rank ``rank_offset + r``);
        a session is one id here standing for each replica's own."""
        down = [i for i, r in enumerate(self.replicas) if r.is_dead]
        if down:
            raise errors.StageDeadError(self.stage_id, f"replicas {down} are down")
        each: list[ops.ControlOp] = [op] * len(self.replicas)
        if isinstance(op, ops.InitWeightTransfer) and op.backend == "nccl":
            each = self._ranked(op)
        elif isinstance(op, ops.StartWeightUpdate):
            if (op.update_info or {}).get("shared_staging"):
                raise errors.InvalidRequestError(
                    "update_info.shared_staging", f"stage {self.stage_id} runs "
                    f"{len(self.replicas)} replicas, each with staging of its own: send the "
                    "tensors (ipc handles or the nccl group) instead"
                )  # fmt: skip
        elif isinstance(op, ops.ReceiveWeights | ops.FinishWeightUpdate | ops.AbortWeightUpdate):
            sessions = self._sessions.get(op.session) if op.session is not None else None
            if op.session is not None and sessions is None:
                raise errors.InvalidRequestError(
                    "session", "no such update session (it ended, or another one began)"
                )
            if sessions is not None:
                each = [msgspec.structs.replace(op, session=own) for own in sessions]
        results = await asyncio.gather(
            *(r.call(o) for r, o in zip(self.replicas, each, strict=True)), return_exceptions=True
        )
        if isinstance(op, ops.FinishWeightUpdate):
            if all(isinstance(r, BaseException) for r in results):
                raise results[0]  # type: ignore[misc]
            acks: list[Ack] = []
            for index, result in enumerate(results):
                acks += [
                    msgspec.structs.replace(a, replica_id=index) for a in _as_acks(self, result)
                ]
            return rolled_up(acks)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if isinstance(op, ops.WeightsChecksum):
            sums = [str(r) for r in results]
            return sums[0] if len(set(sums)) == 1 else "replicas differ: " + ",".join(sums)
        first = results[0]
        if isinstance(op, ops.StartWeightUpdate) and isinstance(first, dict):
            own = [r.get("session") if isinstance(r, dict) else None for r in results]
            if all(isinstance(o, str) for o in own):
                session = secrets.token_hex(16)
                self._sessions[session] = [str(o) for o in own]
                while len(self._sessions) > 16:
                    self._sessions.pop(next(iter(self._sessions)))
                first = {**first, "session": session}
        return first

    def _ranked(self, op: ops.InitWeightTransfer) -> list[ops.ControlOp]:
        """Each replica's ``init`` in the trainer's group: its own rank after the first's."""
        info = dict(op.init_info or {})
        offset = info.get("rank_offset", 1)
        size = info.get("world_size", 2)
        if isinstance(offset, int) and isinstance(size, int):
            needed = offset + len(self.replicas)
            if size < needed:
                raise errors.InvalidRequestError(
                    "init_info.world_size", f"is {size}; stage {self.stage_id}'s "
                    f"{len(self.replicas)} replicas each join the group (ranks {offset} to "
                    f"{needed - 1}): at least {needed}"
                )  # fmt: skip
            return [
                msgspec.structs.replace(op, init_info={**info, "rank_offset": offset + i})
                for i in range(len(self.replicas))
            ]
        return [op] * len(self.replicas)

    def _settle(self, op: ops.ControlOp, answered: dict[int, Any]) -> None:
        """Each replica's sleep state from its answer."""
        for index, result in answered.items():
            status = result[0].status if isinstance(result, list) and result else "ERROR"
            if isinstance(op, ops.Sleep):
                if status in ("SUCCESS", "SKIPPED"):
                    self.states[index], self.levels[index] = ASLEEP, op.level
                    self._prefixes.forget(index)
                elif self.states[index] == DRAINING:
                    self.states[index] = AWAKE  # its sleep failed: it serves on
            elif status in ("SUCCESS", "SKIPPED"):
                self.states[index], self.levels[index] = AWAKE, None
        for index, state in enumerate(self.states):
            if state == DRAINING and index not in answered:
                self.states[index] = AWAKE

    async def _status(self, targets: list[int]) -> dict[str, Any]:
        async def one(index: int) -> dict[str, Any]:
            replica = self.replicas[index]
            own: dict[str, Any] = {}
            if not replica.is_dead:
                try:
                    own = dict(await replica.call(ops.Status()))
                except (errors.StageDeadError, errors.StageRestartingError) as exc:
                    own = {"error": str(exc)}
            return {
                "replica_id": index,
                "state": self.replica_state(index),
                "level": self.levels[index],
                "pid": replica.pid,
                "in_flight": replica.num_in_flight,
                "restarting": index in self.restarting,
                **{k: v for k, v in own.items() if k not in ("stage_id", "kind", "level")},
            }

        each = await asyncio.gather(*(one(i) for i in targets))
        return {**summarized([e for e in each if e["state"] != DEAD] or each), "replicas": each}


_TRANSFER_OPS = (
    ops.InitWeightTransfer,
    ops.StartWeightUpdate,
    ops.ReceiveWeights,
    ops.FinishWeightUpdate,
    ops.AbortWeightUpdate,
)


_BYTES = ("reserved_bytes", "resident_bytes", "released_bytes", "backup_bytes")
_REPLICA_ONLY = ("replica_id", "state", "level", "pid", "in_flight", "restarting")


def summarized(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage's status from its replicas': queues and memory summed (per tag too), what
    is asleep or invalid only what is so on every replica (the stage serves while one
    serves), the rest as the first replica has it."""
    summary = {k: v for k, v in each[0].items() if k not in _REPLICA_ONLY}
    for key in ("num_running", "num_waiting"):
        values = [e[key] for e in each if isinstance(e.get(key), int)]
        if values:
            summary[key] = sum(values)
    for key in ("is_sleeping", "weights_valid"):
        values = [e[key] for e in each if isinstance(e.get(key), bool)]
        if values:
            summary[key] = all(values) if key == "is_sleeping" else any(values)
    tag_lists = [e["sleeping_tags"] for e in each if isinstance(e.get("sleeping_tags"), list)]
    if tag_lists:
        summary["sleeping_tags"] = [t for t in tag_lists[0] if all(t in ts for ts in tag_lists)]
    memories = [e["memory"] for e in each if isinstance(e.get("memory"), dict)]
    if memories:
        memory = {**memories[0], **{k: sum(int(m.get(k, 0)) for m in memories) for k in _BYTES}}
        tags: dict[str, dict[str, Any]] = {}
        for m in memories:
            for tag, stats in (m.get("tags") or {}).items():
                into = tags.setdefault(tag, {**stats, **dict.fromkeys(_BYTES, 0)})
                for k in _BYTES:
                    into[k] += int(stats.get(k, 0))
                into["is_asleep"] = into.get("is_asleep", True) and bool(stats.get("is_asleep"))
        memory["tags"] = tags
        summary["memory"] = memory
    return summary


def _acks_op(op: ops.ControlOp) -> bool:
    return isinstance(op, ops.Sleep | ops.WakeUp | ops.UpdateWeights)


def _as_acks(client: ReplicatedStageClient, result: Any) -> list[Ack]:
    if isinstance(result, list) and result and all(isinstance(a, Ack) for a in result):
        return result
    error = f"{type(result).__name__}: {result}"
    return [make_ack(client.stage_id, status="ERROR", error_msg=error)]


def rolled_up(acks: list[Ack]) -> list[Ack]:
    """``acks`` with one whose status is the stage's first: the first ``ERROR``, else the
    first ``SUCCESS``, else the first (each replica's rank 0 speaks for its ranks)."""
    heads = [a for a in acks if a.rank == 0]
    for status in ("ERROR", "SUCCESS"):
        lead = next((a for a in heads if a.status == status), None)
        if lead is not None:
            return [lead, *(a for a in acks if a is not lead)]
    return acks


def check_replicas(
    pipeline: Any, *, on_cpu_cores: int, cuda_devices: int, on_ray: bool = False
) -> None:
    """Each stage's replicas fit what it is given (``ConfigError`` naming the key): on the
    CPU, ``replicas`` x ``tensor_parallel_size`` x ``torch_threads`` (when set) within the
    machine's cores; on CUDA, ``replicas`` x ``tensor_parallel_size`` devices from the
    stage's first, within the devices there are (when CUDA is there to count them). On Ray
    (``on_ray``) the replicas go where their placements find room: Ray refuses what fits
    nowhere, and this machine's cores and devices say nothing."""
    from omnistage.config import ConfigError

    if on_ray:
        return
    for stage in pipeline.stages:
        key = f"stages.{stage.stage_id}.replicas"
        ranks = stage.replicas * stage.tensor_parallel_size
        if stage.replicas == 1:
            continue
        if not stage.device.startswith("cuda"):
            if stage.torch_threads and ranks * stage.torch_threads > on_cpu_cores:
                raise ConfigError(
                    f"{key}: {stage.replicas} replicas x {stage.tensor_parallel_size} ranks x "
                    f"{stage.torch_threads} torch_threads is more than the {on_cpu_cores} "
                    "cores here"
                )
            continue
        if stage.replica_devices is not None or not cuda_devices:
            continue
        base = int(stage.device.partition(":")[2] or 0)
        if base + ranks > cuda_devices:
            raise ConfigError(
                f"{key}: {stage.replicas} replicas x {stage.tensor_parallel_size} ranks from "
                f"{stage.device} need devices up to cuda:{base + ranks - 1}; there are "
                f"{cuda_devices} (or name them: replica_devices)"
            )


def replicated(clients: Sequence[StageClient]) -> Any:
    """One replica's client as it is; several behind a ``ReplicatedStageClient``."""
    return clients[0] if len(clients) == 1 else ReplicatedStageClient(clients)
