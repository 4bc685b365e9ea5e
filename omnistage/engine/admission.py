"""Per-stage admission and the stage state machine, on the engine client's event loop.

Each stage is ``awake → sleeping → asleep → waking → awake``; a stage whose process dies is
``restarting`` while the server brings it back, or ``dead`` when it will not come back.
Admission is per stage: a request that needs an asleep (or restarting, or dead) stage fails
fast; one that needs a paused (but awake) stage waits until it resumes (at most
``paused_wait_s``, then ``StagePausedError``). Before a sleep
touches memory, admission closes and the sleeper waits until every request already being
submitted to that stage has been submitted (``admitting`` back to zero).

Requests already in the pipeline and *bound* for a later stage (say, in the thinker on their
way to the image decoder) follow the mode of that stage's sleep when they reach it: with
``wait`` the sleep lets them in and drains them too, with ``keep`` they wait at the hand-off
until the stage is awake and resumed, with ``abort`` they end as aborted.

This module is the only writer of the gate's state: everything else calls its verbs and
reads ``stages``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from omnistage.errors import (
    StageAsleepError,
    StageBusyError,
    StageDeadError,
    StagePausedError,
    StageRestartingError,
)
from omnistage.stage.control import Ack

AWAKE, SLEEPING, ASLEEP, WAKING, RESTARTING, DEAD = (
    "awake",
    "sleeping",
    "asleep",
    "waking",
    "restarting",
    "dead",
)
STATES = (AWAKE, SLEEPING, ASLEEP, WAKING, RESTARTING, DEAD)
TRANSITIONS = (SLEEPING, WAKING)
UNAVAILABLE = (SLEEPING, ASLEEP, WAKING)


@dataclass
class StageState:
    state: str = AWAKE
    level: int | None = None
    paused: bool = False
    admitting: int = 0
    detail: str = ""
    sleep_mode: str | None = None  # mode of the sleep in progress or in force
    bound: int = 0  # requests in the pipeline that will reach this stage later
    admits_bound: bool = False  # a "wait" sleep is letting bound requests in before it drains
    weights_valid: bool = True  # False after a level-2 wake with reload=false, until updated
    target_level: int | None = None  # level of the sleep in progress
    restarts: int = 0  # times the server restarted the stage's process
    last_exit: str = ""  # why its last process ended


class AdmissionGate:
    """``auto_wake``: asleep stages are woken by the server when a request needs them, so a
    request refused for one may be retried (``Retry-After``). ``paused_wait_s``: the longest
    a request waits for a paused stage to resume before it is refused (``StagePausedError``):
    never without bound."""

    def __init__(
        self, num_stages: int, *, auto_wake: bool = False, paused_wait_s: float = 300.0
    ) -> None:
        self.stages = [StageState() for _ in range(num_stages)]
        self.auto_wake = auto_wake
        self.paused_wait_s = paused_wait_s
        self._cond: asyncio.Condition | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    # -- admission ------------------------------------------------------------------------

    def _raise_if_unavailable(self, stage_id: int) -> None:
        s = self.stages[stage_id]
        if s.state == DEAD:
            raise StageDeadError(stage_id, s.detail)
        if s.state == RESTARTING:
            raise StageRestartingError(stage_id, s.last_exit)
        if s.state in UNAVAILABLE:
            raise StageAsleepError(stage_id, retry_after=self.auto_wake)

    def check_alive(self, stage_id: int) -> None:
        """Raise unless the stage's process is up (``StageRestartingError``, ``StageDeadError``)."""
        if self.stages[stage_id].state in (DEAD, RESTARTING):
            self._raise_if_unavailable(stage_id)

    def check_available(self, stage_ids: Iterable[int]) -> None:
        """Fail fast if any of the stages is asleep or going to sleep (naming every such
        stage), restarting or dead."""
        ids = list(stage_ids)
        for sid in ids:
            if self.stages[sid].state in (DEAD, RESTARTING):
                self._raise_if_unavailable(sid)
        asleep = [sid for sid in ids if self.stages[sid].state in UNAVAILABLE]
        if asleep:
            raise StageAsleepError(asleep, retry_after=self.auto_wake)

    @asynccontextmanager
    async def admit(self, stage_id: int, *, bound: bool = False) -> AsyncIterator[None]:
        """Hold admission to ``stage_id`` while a request is being submitted to it.

        ``bound``: the request was already in the pipeline (handed over from an earlier
        stage), so a sleep of this stage treats it by its mode (see the module docstring);
        once admitted it no longer counts as bound.
        """
        s = self.stages[stage_id]
        async with self.cond:
            if bound and s.sleep_mode == "keep" and s.state in UNAVAILABLE:
                await self.cond.wait_for(
                    lambda: s.state not in UNAVAILABLE or s.sleep_mode != "keep"
                )
            if not (bound and s.admits_bound):
                self._raise_if_unavailable(stage_id)
                if s.paused:
                    await self._wait_for_resume(stage_id)
                    self._raise_if_unavailable(stage_id)
            else:  # let in by a wait sleep's drain, unless its process died meanwhile
                self.check_alive(stage_id)
            s.admitting += 1
            if bound:
                s.bound -= 1
        try:
            yield
        finally:
            # Counted down before any await: a submitter cancelled while waiting for the lock
            # must not leave ``admitting`` above zero (a sleep would wait for it forever).
            s.admitting -= 1
            await asyncio.shield(self._notify())

    async def _wait_for_resume(self, stage_id: int) -> None:
        """Wait (holding the condition, as ``admit``) until the stage is no longer paused or
        no longer awake; ``StagePausedError`` after ``paused_wait_s``."""
        s = self.stages[stage_id]
        try:
            await asyncio.wait_for(
                self.cond.wait_for(lambda: not s.paused or s.state != AWAKE), self.paused_wait_s
            )
        except TimeoutError:
            raise StagePausedError(stage_id, self.paused_wait_s) from None

    def add_bound(self, stage_ids: Iterable[int]) -> None:
        for sid in stage_ids:
            self.stages[sid].bound += 1

    def release_bound(self, stage_ids: Iterable[int]) -> None:
        """Synchronous (safe in any ``finally``); waiters are woken by a scheduled notify."""
        for sid in stage_ids:
            self.stages[sid].bound -= 1
        self._notify_soon()

    # -- transitions ----------------------------------------------------------------------

    def begin_transition(
        self, stage_ids: list[int], target: str, level: int | None = None
    ) -> dict[int, str]:
        """Mark stages as transitioning (no await in between: atomic on the loop); ``level``
        is a sleep's target level.

        Raises ``StageBusyError`` if one is already mid-transition, ``StageDeadError`` or
        ``StageRestartingError`` if its process is gone. Returns the previous states.
        """
        for sid in stage_ids:
            s = self.stages[sid]
            if s.state in (DEAD, RESTARTING):
                self._raise_if_unavailable(sid)
            if s.state in TRANSITIONS:
                raise StageBusyError(sid, s.state)
        previous = {sid: self.stages[sid].state for sid in stage_ids}
        for sid in stage_ids:
            self.stages[sid].state = target
            self.stages[sid].target_level = level
        return previous

    async def close_and_drain_admission(
        self, stage_ids: list[int], sleep_mode: str | None = None
    ) -> None:
        """Close admission and wait until no submit to these stages is in progress."""
        async with self.cond:
            for sid in stage_ids:
                self.stages[sid].paused = True
                if sleep_mode is not None:
                    self.stages[sid].sleep_mode = sleep_mode
            await self.cond.wait_for(
                lambda: all(self.stages[sid].admitting == 0 for sid in stage_ids)
            )

    async def drain_bound(self, stage_ids: list[int], timeout_s: float) -> None:
        """For a ``wait`` sleep: let requests bound for these stages in, and wait until they
        all are (raises ``TimeoutError`` naming ``drain_timeout_s``)."""
        async with self.cond:
            for sid in stage_ids:
                self.stages[sid].admits_bound = True
            self.cond.notify_all()
            try:
                await asyncio.wait_for(
                    self.cond.wait_for(
                        lambda: all(
                            self.stages[sid].bound == 0 and self.stages[sid].admitting == 0
                            for sid in stage_ids
                        )
                    ),
                    timeout_s,
                )
            except TimeoutError:
                raise TimeoutError(
                    f"sleep(mode='wait') gave up: requests on their way to stage(s) {stage_ids} "
                    f"still upstream after {timeout_s:g}s; raise drain_timeout_s or use mode 'abort' or 'keep'"
                ) from None
            finally:
                for sid in stage_ids:
                    self.stages[sid].admits_bound = False

    async def record_sleep_result(
        self, stage_id: int, ack: Ack, previous: str, was_paused: bool, level: int
    ) -> bool:
        """The state a sleep's ACK leaves the stage in; True if the stage must be resumed
        (the sleep failed after its engine paused, and the stage was serving before)."""
        async with self.cond:
            s = self.stages[stage_id]
            s.target_level = None
            must_resume = False
            if s.state in (DEAD, RESTARTING):
                pass  # its process died meanwhile: the supervisor owns its state now
            elif ack.status == "ERROR" and ack.metadata.sleeping_tags:
                # Failed half-way: part of the memory is gone, so it is asleep (a wake maps it
                # back and reloads); the ACK says what failed.
                s.state, s.level = ASLEEP, 2
            elif ack.status == "ERROR":
                s.state, s.paused = previous, was_paused
                must_resume = previous == AWAKE and not was_paused
            else:
                s.state, s.level = ASLEEP, level
            self.cond.notify_all()
            return must_resume

    async def record_wake_result(self, stage_id: int, ack: Ack, previous: str) -> bool:
        """The state a wake's ACK leaves the stage in; True if the stage was asleep, is awake
        now and its engine still waits for a resume (``ack.metadata.paused``: an AR stage)."""
        async with self.cond:
            s = self.stages[stage_id]
            was_asleep = previous == ASLEEP
            if s.state in (DEAD, RESTARTING):
                return False
            if ack.status != "ERROR":
                s.weights_valid = ack.metadata.weights_valid
            if ack.status == "ERROR":
                s.state = previous
            elif ack.metadata.sleeping_tags:
                s.state = ASLEEP
            else:
                s.state, s.level = AWAKE, None
                if was_asleep and not ack.metadata.paused:
                    s.paused = False  # it schedules again by itself; one only paused stays so
            self.cond.notify_all()
            return s.state == AWAKE and was_asleep and ack.metadata.paused

    def set_weights_valid(self, stage_id: int, valid: bool) -> None:
        self.stages[stage_id].weights_valid = valid

    async def reopen(self, stage_ids: Iterable[int]) -> None:
        """Unpause the stages that are still awake; one that began a transition meanwhile
        keeps the state its sleep or wake gives it."""
        async with self.cond:
            for sid in stage_ids:
                if self.stages[sid].state == AWAKE:
                    self.stages[sid].paused = False
            self.cond.notify_all()

    async def wait_settled(self, stage_id: int) -> str:
        """Wait until the stage is not mid-transition; returns its state."""
        s = self.stages[stage_id]
        async with self.cond:
            await self.cond.wait_for(lambda: s.state not in TRANSITIONS)
        return s.state

    # -- process deaths -------------------------------------------------------------------

    def restart_level(self, stage_id: int) -> int | None:
        """The sleep level a stage whose process died comes back at (``None``: awake): the
        level it was asleep at, the target of a sleep in progress, or (a wake in progress)
        the level it was waking from — so a failed wake can simply be retried."""
        s = self.stages[stage_id]
        if s.state == SLEEPING:
            return s.target_level
        if s.state in (ASLEEP, WAKING):
            return s.level
        if s.state == AWAKE and not s.weights_valid:
            return 2  # woken without weights: nothing worth loading
        return None

    def mark_dead(self, stage_id: int, detail: str, *, restarting: bool) -> None:
        """The stage's process is gone: ``restarting`` while the server brings it back."""
        s = self.stages[stage_id]
        s.last_exit = detail
        s.state, s.detail = (RESTARTING, "") if restarting else (DEAD, detail)
        self._notify_soon()

    def mark_restarted(self, stage_id: int, *, level: int | None, paused: bool) -> None:
        """A new process of the stage is ready, asleep at ``level`` (``None``: awake)."""
        s = self.stages[stage_id]
        s.restarts += 1
        s.state = AWAKE if level is None else ASLEEP
        s.level = level
        s.paused = paused or level is not None
        s.weights_valid = True  # asleep: the wake that brings it back reloads them
        s.detail = ""
        self._notify_soon()

    def _notify_soon(self) -> None:
        if self._cond is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: nobody to wake
                asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()
