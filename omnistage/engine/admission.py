"""Per-stage admission and the sleep/wake state machine, on the engine client's event loop.

Each stage is ``awake → sleeping → asleep → waking → awake`` (plus ``failed`` and ``dead``).
Admission is per stage: a request that needs an asleep stage fails fast with
``StageAsleepError``; one that needs a paused (but awake) stage waits until it resumes.
Before a sleep touches memory, admission closes and the sleeper waits until every request
already being submitted to that stage has been submitted (``admitting`` back to zero).
"""

from __future__ import annotations

import asyncio
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
    async def admit(self, stage_id: int) -> AsyncIterator[None]:
        """Hold admission to ``stage_id`` while a request is being submitted to it."""
        s = self.stages[stage_id]
        async with self.cond:
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
