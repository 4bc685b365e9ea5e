"""Per-stage admission and the sleep/wake state machine, on the engine client's event loop.

Each stage is ``awake → sleeping → asleep → waking → awake`` (plus ``failed`` and ``dead``).
Admission is per stage: a request that needs an asleep stage fails fast with
``StageAsleepError``; one that needs a paused (but awake) stage waits until it resumes.
Before a sleep touches memory, admission closes and the sleeper waits until every request
already being submitted to that stage has been submitted (``admitting`` back to zero).

Requests already in the pipeline and *bound* for a later stage (say, in the thinker on their
way to the image decoder) follow the mode of that stage's sleep when they reach it: with
``wait`` the sleep lets them in and drains them too, with ``keep`` they wait at the hand-off
until the stage is awake and resumed, with ``abort`` they end as aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from omnistage.errors import StageAsleepError, StageBusyError, StageDeadError

AWAKE, SLEEPING, ASLEEP, WAKING, FAILED, DEAD = (
    "awake",
    "sleeping",
    "asleep",
    "waking",
    "failed",
    "dead",
)
TRANSITIONS = (SLEEPING, WAKING)


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


class AdmissionGate:
    def __init__(self, num_stages: int) -> None:
        self.stages = [StageState() for _ in range(num_stages)]
        self._cond: asyncio.Condition | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _raise_if_unavailable(self, stage_id: int) -> None:
        s = self.stages[stage_id]
        if s.state == DEAD:
            raise StageDeadError(stage_id, s.detail)
        if s.state in (SLEEPING, ASLEEP, WAKING, FAILED):
            raise StageAsleepError(stage_id)

    def check_available(self, stage_ids: Iterable[int]) -> None:
        """Fail fast if any of the stages is asleep (or going to sleep, or dead)."""
        for sid in stage_ids:
            self._raise_if_unavailable(sid)

    @asynccontextmanager
    async def admit(self, stage_id: int, *, bound: bool = False) -> AsyncIterator[None]:
        """Hold admission to ``stage_id`` while a request is being submitted to it.

        ``bound``: the request was already in the pipeline (handed over from an earlier
        stage), so a sleep of this stage treats it by its mode (see the module docstring).
        """
        s = self.stages[stage_id]
        async with self.cond:
            if bound and s.sleep_mode == "keep" and s.state in (SLEEPING, ASLEEP, WAKING):
                await self.cond.wait_for(
                    lambda: s.state in (AWAKE, DEAD, FAILED) or s.sleep_mode != "keep"
                )
            if not (bound and s.admits_bound):
                self._raise_if_unavailable(stage_id)
                if s.paused:
                    await self.cond.wait_for(lambda: not s.paused or s.state != AWAKE)
                    self._raise_if_unavailable(stage_id)
            s.admitting += 1
        try:
            yield
        finally:
            # Counted down before any await: a submitter cancelled while waiting for the lock
            # must not leave ``admitting`` above zero (a sleep would wait for it forever).
            s.admitting -= 1
            await asyncio.shield(self._notify())

    def begin_transition(self, stage_ids: list[int], target: str) -> dict[int, str]:
        """Mark stages as transitioning (no await in between: atomic on the loop).

        Raises ``StageBusyError`` if one is already mid-transition, ``StageDeadError`` if dead.
        Returns the previous states, for rollback.
        """
        for sid in stage_ids:
            s = self.stages[sid]
            if s.state == DEAD:
                raise StageDeadError(sid, s.detail)
            if s.state in TRANSITIONS:
                raise StageBusyError(sid, s.state)
        previous = {sid: self.stages[sid].state for sid in stage_ids}
        for sid in stage_ids:
            self.stages[sid].state = target
        return previous

    async def close_and_drain_admission(self, stage_ids: list[int]) -> None:
        """Close admission and wait until no submit to these stages is in progress."""
        async with self.cond:
            for sid in stage_ids:
                self.stages[sid].paused = True
            await self.cond.wait_for(
                lambda: all(self.stages[sid].admitting == 0 for sid in stage_ids)
            )

    def add_bound(self, stage_ids: Iterable[int]) -> None:
        for sid in stage_ids:
            self.stages[sid].bound += 1

    def release_bound(self, stage_ids: Iterable[int]) -> None:
        """Synchronous (safe in any ``finally``); waiters are woken by a scheduled notify."""
        for sid in stage_ids:
            self.stages[sid].bound -= 1
        if self._cond is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: nobody to wake
                asyncio.get_running_loop().create_task(self._notify())

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

    async def set_state(
        self, stage_id: int, state: str, *, paused: bool | None = None, level: int | None = -1
    ) -> None:
        async with self.cond:
            s = self.stages[stage_id]
            if s.state != DEAD:
                s.state = state
            if paused is not None:
                s.paused = paused
            if level != -1:
                s.level = level
            self.cond.notify_all()

    async def reopen(self, stage_ids: Iterable[int]) -> None:
        """Unpause the stages that are still awake; one that began a transition meanwhile
        keeps the state its sleep or wake gives it."""
        async with self.cond:
            for sid in stage_ids:
                if self.stages[sid].state == AWAKE:
                    self.stages[sid].paused = False
            self.cond.notify_all()

    def mark_dead(self, stage_id: int, detail: str) -> None:
        s = self.stages[stage_id]
        s.state, s.detail = DEAD, detail
        if self._cond is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()
