"""Operator conveniences on top of sleep/wake: wake a parked stage when a request needs it
(``auto_wake``), and park a stage that has been idle for a while (``idle_sleep_s``).

Both go through ``StageControl.sleep`` / ``wake_up``, so admission, ACKs, metrics and the
HTTP layer's sleeping set see them like any other transition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from omnistage.engine import admission as adm
from omnistage.engine.control import StageControl
from omnistage.engine.events import TRIGGER_AUTO_WAKE, TRIGGER_IDLE_SLEEP
from omnistage.logs import log_event

logger = logging.getLogger(__name__)


class Autopilot:
    def __init__(
        self,
        control: StageControl,
        num_in_flight: Callable[[int], int],
        *,
        auto_wake: bool = False,
    ) -> None:
        self.control = control
        self.gate = control.gate
        self.num_in_flight = num_in_flight
        self.auto_wake = auto_wake
        self._wakes: dict[int, asyncio.Future[Any]] = {}
        self._last_used = [time.monotonic()] * control.num_stages
        self._monitor: asyncio.Task[None] | None = None

    def touch(self, stage_ids: list[int]) -> None:
        now = time.monotonic()
        for sid in stage_ids:
            self._last_used[sid] = now

    async def ensure_awake(self, stage_ids: list[int]) -> None:
        """With ``auto_wake``: wake the asleep stages among ``stage_ids`` (one wake per stage
        however many requests are waiting) and wait for transitions in progress to end."""
        self.touch(stage_ids)
        if not self.auto_wake:
            return
        for sid in stage_ids:
            for _ in range(3):  # a stage that goes back to sleep meanwhile gets another try
                if await self.gate.wait_settled(sid) != adm.ASLEEP:
                    break
                wake = self._wakes.get(sid)
                if wake is None or wake.done():
                    self._log_auto_wake(sid)
                    wake = asyncio.ensure_future(
                        self.control.wake_up([sid], resume=True, trigger=TRIGGER_AUTO_WAKE)
                    )
                    self._wakes[sid] = wake
                with contextlib.suppress(Exception):  # the admission check reports the outcome
                    await asyncio.shield(wake)

    def _log_auto_wake(self, sid: int) -> None:
        name = self.control.config.stages[sid].display_name
        log_event(
            logger,
            logging.INFO,
            TRIGGER_AUTO_WAKE,
            f"auto-wake: stage {sid} ({name}) is asleep and a request needs it",
            stage_id=sid,
            stage=name,
            sleep_level=self.gate.stages[sid].level,
            trigger=TRIGGER_AUTO_WAKE,
        )

    def start_idle_monitor(self, poll_s: float = 0.25) -> None:
        """Park stages whose config sets ``idle_sleep_s`` after that long without requests."""
        if self._monitor is None and any(s.idle_sleep_s for s in self.control.config.stages):
            self._monitor = asyncio.get_running_loop().create_task(self._watch_idle(poll_s))

    async def _watch_idle(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            now = time.monotonic()
            for stage in self.control.config.stages:
                sid, s = stage.stage_id, self.gate.stages[stage.stage_id]
                if self.num_in_flight(sid) or s.bound:
                    self._last_used[sid] = now  # the idle clock starts when work ends
                    continue
                idle = (
                    stage.idle_sleep_s is not None
                    and s.state == adm.AWAKE
                    and not s.paused
                    and now - self._last_used[sid] >= stage.idle_sleep_s
                )
                if idle:
                    idle_s = now - self._last_used[sid]
                    log_event(
                        logger,
                        logging.INFO,
                        TRIGGER_IDLE_SLEEP,
                        f"idle-sleep: stage {sid} ({stage.display_name}) idle for {idle_s:.0f}s",
                        stage_id=sid,
                        stage=stage.display_name,
                        sleep_level=stage.idle_sleep_level,
                        idle_s=round(idle_s, 3),
                        idle_sleep_s=stage.idle_sleep_s,
                        trigger=TRIGGER_IDLE_SLEEP,
                    )
                    with contextlib.suppress(Exception):  # a racing transition wins; retry later
                        await self.control.sleep(
                            [sid],
                            level=stage.idle_sleep_level,
                            mode="wait",
                            trigger=TRIGGER_IDLE_SLEEP,
                        )
                    self.touch([sid])

    def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
