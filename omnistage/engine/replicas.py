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
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from omnistage import errors
from omnistage.engine.replica_parts import (
    ASLEEP,
    AWAKE,
    DEAD,
    DRAINING,
    PrefixPlacement,
    ReplicaDeath,
    replica_acks,
    rolled_up,
    summarized,
)
from omnistage.engine.replica_weights import TRANSFER_OPS, transfer
from omnistage.engine.stage_client import StageClient
from omnistage.stage import control as ops
from omnistage.stage.control import Ack
from omnistage.stage.kinds import stage_kind
from omnistage.stage.messages import (
    HandoffRef,
    OutputMessage,
    StageInfo,
    StageRequest,
    StartupOptions,
    Upstream,
)

logger = logging.getLogger(__name__)


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
        self._caches_prefixes = stage_kind(self.kind).has_prefix_cache
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
        candidates = self.serving()
        if not candidates and self.restarting:  # the ones that served are coming back
            raise errors.StageRestartingError(
                self.stage_id, f"its serving replicas {sorted(self.restarting)} restart"
            )
        candidates = candidates or [i for i, r in enumerate(self.replicas) if not r.is_dead]
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
        if token_ids and self._caches_prefixes:
            self._prefixes.record(token_ids, index)
        return queue

    def _in_flight(self, index: int, request_id: str) -> bool:
        return self.replicas[index].holds(request_id)

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
        if isinstance(op, (*TRANSFER_OPS, ops.WeightsChecksum)):
            return await transfer(self, op)
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
            acks += replica_acks(self.stage_id, index, result)
        return rolled_up(acks)

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


def _acks_op(op: ops.ControlOp) -> bool:
    return isinstance(op, ops.Sleep | ops.WakeUp | ops.UpdateWeights)


def replicated(clients: Sequence[StageClient]) -> Any:
    """One replica's client as it is; several behind a ``ReplicatedStageClient``."""
    return clients[0] if len(clients) == 1 else ReplicatedStageClient(clients)
