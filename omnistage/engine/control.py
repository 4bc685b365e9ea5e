"""``StageControl``: orders every control operation over a pipeline's stages.

Sleep: admission to the target stages closes, submits in progress finish (and, for mode
``wait``, requests bound for them arrive), then one control call per stage — a typed
operation (``omnistage.stage.control``), all stages at once — and the ACKs settle each
stage's state in the admission gate. Wake, pause, resume and weight updates follow the same
shape. Every operation answers its ACKs flat: one per stage and rank, rank 0's (the stage's
status) first. The whole of a sleep or wake runs shielded: a caller that gives up never
leaves a stage half-transitioned. See ``docs/control-plane.md``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from omnistage.config import PipelineConfig
from omnistage.engine import admission as adm
from omnistage.engine.events import TRIGGER_API, log_sleep, log_wake, log_weights
from omnistage.engine.replica_parts import (
    check_replica_ids,
    replicas_together,
    serves_beside,
)
from omnistage.engine.stage_client import EngineStageClient
from omnistage.errors import SleepModeDisabledError, StageDeadError, StageRestartingError
from omnistage.stage import control as ops
from omnistage.stage.control import Ack, make_ack
from omnistage.stage.kinds import stage_kind
from omnistage.stage.vocabulary import check_stage_ids

ControlListener = Callable[[str, list[Ack]], None]

logger = logging.getLogger(__name__)


class StageControl:
    def __init__(
        self,
        config: PipelineConfig,
        clients: Sequence[EngineStageClient],
        gate: adm.AdmissionGate,
        *,
        resume_after_wake: bool = False,
    ) -> None:
        self.config = config
        self.clients = list(clients)
        self.gate = gate
        # The HTTP server wakes and resumes in one call; the Python API does not.
        self.resume_after_wake = resume_after_wake
        self._listeners: list[ControlListener] = []

    @property
    def num_stages(self) -> int:
        return len(self.clients)

    def add_listener(self, listener: ControlListener) -> None:
        """``listener(operation, acks)`` after every sleep, wake_up and update_weights."""
        self._listeners.append(listener)

    def notify(self, operation: str, acks: list[Ack]) -> None:
        for listener in self._listeners:
            listener(operation, acks)

    # -- argument checks ----------------------------------------------------------------

    def _name(self, stage_id: int) -> str:
        return self.config.stages[stage_id].display_name

    def check_stage_ids(
        self, stage_ids: Sequence[int] | None, field: str = "stage_ids"
    ) -> list[int]:
        if stage_ids is None:
            return list(range(self.num_stages))
        return check_stage_ids(stage_ids, self.num_stages, field)

    def _check_sleep_mode(self, stage_ids: list[int]) -> None:
        for sid in stage_ids:
            if not self.config.stages[sid].enable_sleep_mode:
                raise SleepModeDisabledError(sid)

    async def _call_each(
        self, stage_ids: list[int], op: ops.ControlOp, replica_ids: Sequence[int] | None = None
    ) -> dict[int, Any]:
        """One control call per stage (to ``replica_ids`` of a replicated one, None: all), all
        at once; exceptions are returned, not raised."""

        async def one(sid: int) -> Any:
            client = self.clients[sid]
            if replica_ids is not None and hasattr(client, "replicas"):
                return await client.call(op, replica_ids)  # type: ignore[call-arg]
            return await client.call(op)

        if len(stage_ids) == 1:  # no task to schedule for the common case: one event-loop turn
            (sid,) = stage_ids
            try:
                return {sid: await one(sid)}
            except Exception as exc:
                return {sid: exc}
        results = await asyncio.gather(*(one(sid) for sid in stage_ids), return_exceptions=True)
        return dict(zip(stage_ids, results, strict=True))

    # -- sleep / wake -------------------------------------------------------------------

    async def sleep(
        self,
        stage_ids: Sequence[int],
        level: int = 2,
        mode: str = "abort",
        tags: Sequence[str] | None = None,
        *,
        trigger: str = TRIGGER_API,
        replica_ids: Sequence[int] | None = None,
    ) -> list[Ack]:
        """``trigger`` (``api``, ``auto_wake``, ``idle_sleep``) goes to the log; ``replica_ids``:
        those replicas, the stage asleep only if no other serves (docs/distributed.md)."""
        ids = self.check_stage_ids(stage_ids)
        op = ops.Sleep(level=level, mode=mode, tags=None if tags is None else list(tags))
        self._check_sleep_mode(ids)
        if not ids:
            return []
        flat: list[Ack] = []
        if replica_ids is not None:
            check_replica_ids(self.config, ids, replica_ids)
            beside = [
                sid
                for sid in ids
                if self.gate.stages[sid].state == adm.AWAKE
                and serves_beside(self.clients[sid], replica_ids)
            ]
            if beside:
                flat += await asyncio.shield(
                    self._replicas_op("sleep", beside, op, replica_ids, trigger=trigger)
                )
            ids = [sid for sid in ids if sid not in beside]
            if not ids:
                return flat
        previous = self.gate.begin_transition(ids, adm.SLEEPING, level=op.level)
        was_paused = {sid: self.gate.stages[sid].paused for sid in ids}
        return flat + await asyncio.shield(
            self._sleep(ids, previous, was_paused, op, trigger=trigger, replica_ids=replica_ids)
        )

    async def _replicas_op(
        self,
        operation: str,
        ids: list[int],
        op: ops.Sleep | ops.WakeUp,
        replica_ids: Sequence[int],
        *,
        trigger: str,
    ) -> list[Ack]:
        """A sleep or wake of some replicas of stages that serve on: no stage transition."""
        start = time.perf_counter()
        results = await self._call_each(ids, op, replica_ids)
        metadata = {"level": op.level, "mode": op.mode} if isinstance(op, ops.Sleep) else {}
        acks = {sid: as_acks(sid, results[sid], **metadata) for sid in ids}
        elapsed_ms = (time.perf_counter() - start) * 1e3
        for sid in ids:
            if isinstance(op, ops.Sleep):
                log_sleep(logger, self._name(sid), acks[sid][0], trigger=trigger,
                          elapsed_ms=elapsed_ms)  # fmt: skip
            else:
                log_wake(logger, self._name(sid), acks[sid][0], trigger=trigger,
                         elapsed_ms=elapsed_ms, reload=op.reload)  # fmt: skip
        flat = [ack for sid in ids for ack in acks[sid]]
        self.notify(operation, flat)
        raise_if_gone(results)
        return flat

    async def _sleep(
        self,
        ids: list[int],
        previous: dict[int, str],
        was_paused: dict[int, bool],
        op: ops.Sleep,
        *,
        trigger: str,
        replica_ids: Sequence[int] | None = None,
    ) -> list[Ack]:
        start = time.perf_counter()
        await self.gate.close_and_drain_admission(ids, sleep_mode=op.mode)
        results: dict[int, Any] = {}
        if op.mode == "wait":
            timeout_s = max(self.config.stages[sid].drain_timeout_s for sid in ids)
            try:
                await self.gate.drain_bound(ids, timeout_s)
            except TimeoutError as exc:
                results = dict.fromkeys(ids, exc)
        if not results and op.mode == "wait":
            # A stage fed by another of this sleep drains after it: its requests end only
            # when their input has stopped coming (a streamed edge), so its drain timeout
            # counts from then, not from the upstream stage's own drain.
            for wave in self._upstream_first(ids):
                results.update(await self._call_each(wave, op, replica_ids))
        elif not results:
            results = await self._call_each(ids, op, replica_ids)
        acks = {sid: as_acks(sid, results[sid], level=op.level, mode=op.mode) for sid in ids}
        elapsed_ms = (time.perf_counter() - start) * 1e3
        for sid in ids:
            log_sleep(logger, self._name(sid), acks[sid][0], trigger=trigger, elapsed_ms=elapsed_ms)
        reopen = [
            sid
            for sid in ids
            if await self.gate.record_sleep_result(
                sid, acks[sid][0], previous[sid], was_paused[sid], op.level
            )
        ]
        # A sleep that failed after its engine paused must not leave the engine paused behind
        # an open gate: admitted requests would wait there for a resume nobody sends.
        await self._call_each(reopen, ops.Resume())
        await self.gate.reopen(reopen)
        flat = [ack for sid in ids for ack in acks[sid]]
        self.notify("sleep", flat)
        raise_if_gone(results)
        return flat

    def _upstream_first(self, ids: list[int]) -> list[list[int]]:
        """``ids`` in waves: a stage after every stage of ``ids`` upstream of it (input_from
        names an earlier stage, so one pass in stage order finds each one's depth)."""
        by_id = {s.stage_id: s for s in self.config.stages}
        depth: dict[int, int] = {}
        for sid in sorted(ids):
            up, deepest = by_id[sid].input_from, 0
            while up is not None:
                if up in depth:
                    deepest = max(deepest, depth[up] + 1)
                up = by_id[up].input_from
            depth[sid] = deepest
        return [[s for s in ids if depth[s] == d] for d in sorted(set(depth.values()))]

    async def wake_up(
        self,
        stage_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        reload: bool = True,
        resume: bool | None = None,
        *,
        trigger: str = TRIGGER_API,
        replica_ids: Sequence[int] | None = None,
    ) -> list[Ack]:
        """``replica_ids``: only those replicas of each stage (a stage that serves on its
        other replicas takes them back without a transition; an asleep one wakes on them)."""
        ids = self.check_stage_ids(stage_ids)
        should_resume = self.resume_after_wake if resume is None else resume
        # The stage resumes itself once wholly awake: no second round trip.
        op = ops.WakeUp(
            tags=None if tags is None else list(tags), reload=reload, resume=should_resume
        )
        self._check_sleep_mode(ids)
        if not ids:
            return []
        flat: list[Ack] = []
        if replica_ids is not None:
            check_replica_ids(self.config, ids, replica_ids)
            serving = [sid for sid in ids if self.gate.stages[sid].state == adm.AWAKE]
            if serving:
                flat += await asyncio.shield(
                    self._replicas_op("wake_up", serving, op, replica_ids, trigger=trigger)
                )
            ids = [sid for sid in ids if sid not in serving]
            if not ids:
                return flat
        previous = self.gate.begin_transition(ids, adm.WAKING)
        return flat + await asyncio.shield(
            self._wake_up(ids, previous, op, trigger=trigger, replica_ids=replica_ids)
        )

    async def _wake_up(
        self,
        ids: list[int],
        previous: dict[int, str],
        op: ops.WakeUp,
        *,
        trigger: str,
        replica_ids: Sequence[int] | None = None,
    ) -> list[Ack]:
        start = time.perf_counter()
        results = await self._call_each(ids, op, replica_ids)
        acks = {sid: as_acks(sid, results[sid]) for sid in ids}
        elapsed_ms = (time.perf_counter() - start) * 1e3
        for sid in ids:
            log_wake(
                logger, self._name(sid), acks[sid][0],
                trigger=trigger, elapsed_ms=elapsed_ms, reload=op.reload,
            )  # fmt: skip
        to_resume = [
            sid
            for sid in ids
            if await self.gate.record_wake_result(sid, acks[sid][0], previous[sid])
        ]
        flat = [ack for sid in ids for ack in acks[sid]]
        self.notify("wake_up", flat)
        # Every stage is settled before resuming: a resume that fails must not leave the
        # other stages marked as waking. (A stage asked to resume did so itself; one that
        # still waits here is a kind that ignores the request.)
        if op.resume and to_resume:
            await self.resume(to_resume)
        raise_if_gone(results)
        return flat

    # -- pause / resume / weights -----------------------------------------------------------

    async def pause(self, stage_ids: Sequence[int] | None = None, mode: str = "abort") -> None:
        ids = self.check_stage_ids(stage_ids)
        op = ops.Pause(mode=mode)
        await self.gate.close_and_drain_admission(ids)
        awake = [sid for sid in ids if self.gate.stages[sid].state == adm.AWAKE]
        raise_first(await self._call_each(awake, op))

    async def resume(self, stage_ids: Sequence[int] | None = None) -> None:
        ids = self.check_stage_ids(stage_ids)
        awake = [sid for sid in ids if self.gate.stages[sid].state == adm.AWAKE]
        raise_first(await self._call_each(awake, ops.Resume()))
        await self.gate.reopen(awake)

    async def update_weights(
        self, stage_id: int, path: str, check_finite: bool = True
    ) -> list[Ack]:
        (sid,) = self.check_stage_ids([stage_id], "stage_id")
        self.gate.check_alive(sid)
        op = ops.UpdateWeights(path=str(path), check_finite=check_finite)
        try:
            async with replicas_together(self.gate, self.config, sid):
                acks: list[Ack] = await self.clients[sid].call(op)
        except Exception as exc:
            log_weights(logger, "update_weights", sid, self._name(sid), exc, path=str(path))
            raise
        log_weights(logger, "update_weights", sid, self._name(sid), acks[0], path=str(path))
        if acks[0].status == "SUCCESS":
            self.gate.set_weights_valid(sid, True)
        self.notify("update_weights", acks)
        return acks

    async def reset_prefix_cache(self, stage_ids: Sequence[int] | None = None) -> list[int]:
        """Forget the cached prefixes of the AR stages among ``stage_ids``."""
        ids = self.check_stage_ids(stage_ids)
        cached = [sid for sid in ids if stage_kind(self.config.stages[sid].kind).has_prefix_cache]
        awake = [sid for sid in cached if self.gate.stages[sid].state == adm.AWAKE]
        raise_first(await self._call_each(awake, ops.ResetPrefixCache()))
        return awake

    # -- state --------------------------------------------------------------------------

    async def stage_status(self) -> list[dict[str, Any]]:
        """Per stage: the gate's view (state, level, paused, restarts) and the engine's own
        (memory, queues), the latter absent while the stage's process is gone."""
        statuses = []
        for sid, client in enumerate(self.clients):
            s = self.gate.stages[sid]
            engine: dict[str, Any] = {}
            if s.state not in (adm.DEAD, adm.RESTARTING) and not client.is_dead:
                try:
                    engine = dict(await client.call(ops.Status()))
                except (StageDeadError, StageRestartingError) as exc:
                    engine = {"error": str(exc)}
            statuses.append(
                {
                    "stage_id": sid,
                    "kind": client.kind,
                    "name": self.config.stages[sid].display_name,
                    "state": s.state,
                    "level": s.level,
                    "paused": s.paused,
                    "in_flight": client.num_in_flight,
                    "pid": client.pid,
                    "enable_sleep_mode": self.config.stages[sid].enable_sleep_mode,
                    "restarts": s.restarts,
                    "last_exit": s.last_exit or None,
                    "detail": s.detail,
                    **{
                        k: v
                        for k, v in engine.items()
                        if k not in {"stage_id", "kind", "level", "is_paused"}
                    },
                }
            )
        return statuses

    def sleeping_stage_ids(self) -> set[int]:
        """Stages whose memory is (at least partly) asleep, or going there, and stages woken
        without their weights (reload=false, not yet updated): the truth the HTTP layer
        mirrors. A wakeup racing a sleep then meets the transition (409, not SKIPPED), and a
        wakeup with reload=true reaches a stage whose weights are still missing."""
        return {
            sid
            for sid, s in enumerate(self.gate.stages)
            if s.state in adm.UNAVAILABLE or (s.state == adm.AWAKE and not s.weights_valid)
        }

    def is_paused(self, stage_id: int | None = None) -> bool:
        ids = range(self.num_stages) if stage_id is None else [stage_id]
        return any(self.gate.stages[sid].paused for sid in ids)

    def dead_stage_ids(self) -> list[int]:
        """Stages whose process is gone (dead for good, or being restarted)."""
        return [
            sid for sid, s in enumerate(self.gate.stages) if s.state in (adm.DEAD, adm.RESTARTING)
        ]


def as_acks(stage_id: int, result: Any, **metadata: Any) -> list[Ack]:
    """The ACKs a stage answered (one per rank), or one ERROR ACK for the exception its call
    raised."""
    if isinstance(result, list) and result and all(isinstance(a, Ack) for a in result):
        return result
    if isinstance(result, BaseException):
        error = f"{type(result).__name__}: {result}"
        return [make_ack(stage_id, status="ERROR", error_msg=error, **metadata)]
    raise TypeError(f"stage {stage_id} answered {type(result).__name__}, not its ACKs")


def raise_if_gone(results: dict[int, Any]) -> None:
    """Re-raise the first ``StageDeadError``: the operation did not reach that stage."""
    for result in results.values():
        if isinstance(result, StageDeadError):
            raise result


def raise_first(results: dict[int, Any]) -> None:
    for result in results.values():
        if isinstance(result, BaseException):
            raise result
