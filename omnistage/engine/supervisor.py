"""``Supervisor``: restarts a stage whose process died, as it was.

When a stage's process ends unasked, its requests have already failed (the stage client does
that at once). If the stage has restarts left in its budget (``max_restarts`` within
``window_s``), it is marked ``restarting`` — requests for it get 503 with Retry-After, other
stages keep serving — and a new process is started after a backoff (``backoff_s``, doubling
per recent restart, at most ``max_backoff_s``), with the same config, the weight updates the
stage had taken, and the sleep state it had: asleep at the same level (nothing is loaded that
the operator released), or paused. Out of budget, the stage is ``dead`` until the server
restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.engine import admission as adm
from omnistage.engine.stage_client import EngineStageClient
from omnistage.errors import StageStartupError
from omnistage.stage.messages import SYNC_PREFIX, Ack, StartupOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # within window_s; 0 disables restarts
    window_s: float = 600.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0


class Supervisor:
    def __init__(
        self,
        clients: Sequence[EngineStageClient],
        gate: adm.AdmissionGate,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.clients = list(clients)
        self.gate = gate
        self.policy = policy or RestartPolicy()
        self._recent: list[list[float]] = [[] for _ in self.clients]  # restart start times
        self._weight_sources: list[list[str]] = [[] for _ in self.clients]
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        for client in self.clients:
            client.on_death(self._on_death)

    def observe_control(self, operation: str, acks: list[Ack]) -> None:
        """Control listener: remember what a restart must replay (weight updates)."""
        if operation != "update_weights":
            return
        for ack in acks:
            if ack.status == "SUCCESS" and ack.metadata.weight_sources is not None:
                self._weight_sources[ack.stage_id] = list(ack.metadata.weight_sources)

    def _budget_left(self, stage_id: int) -> bool:
        now = time.monotonic()
        recent = [t for t in self._recent[stage_id] if now - t < self.policy.window_s]
        self._recent[stage_id] = recent
        return not self._stopped and len(recent) < self.policy.max_restarts

    def _on_death(self, stage_id: int) -> None:
        """On the event loop, right after the client failed the stage's requests."""
        reason = self.clients[stage_id].death_reason
        level = self.gate.restart_level(stage_id)
        if any(s.startswith(SYNC_PREFIX) for s in self._weight_sources[stage_id]):
            # Weights a trainer pushed left with the process: come back without any, for
            # the trainer to push again (a wake with reload=false), never with stale ones.
            level = 2
        paused = self.gate.stages[stage_id].paused
        if not self._budget_left(stage_id):
            logger.error(
                "stage %d died (%s); no restarts left (%d within %gs): it stays dead",
                stage_id,
                reason,
                self.policy.max_restarts,
                self.policy.window_s,
            )
            self.gate.mark_dead(stage_id, reason, restarting=False)
            return
        self.gate.mark_dead(stage_id, reason, restarting=True)
        task = asyncio.get_running_loop().create_task(self._restart(stage_id, level, paused))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, stage_id: int, level: int | None, paused: bool) -> None:
        client = self.clients[stage_id]
        while True:
            self._recent[stage_id].append(time.monotonic())
            attempt = len(self._recent[stage_id])
            delay = min(self.policy.backoff_s * 2 ** (attempt - 1), self.policy.max_backoff_s)
            await asyncio.sleep(delay)
            options = StartupOptions(
                sleep_level=level, paused=paused, weight_sources=self._weight_sources[stage_id]
            )
            logger.warning(
                "restarting stage %d (attempt %d, %s)",
                stage_id,
                attempt,
                "awake" if level is None else f"asleep at level {level}",
            )
            try:
                await client.restart(options)
            except (StageStartupError, OSError) as exc:
                logger.error("stage %d failed to restart: %s", stage_id, exc)
                if self._budget_left(stage_id):
                    continue
                self.gate.mark_dead(stage_id, f"restart failed: {exc}", restarting=False)
                return
            self.gate.mark_restarted(stage_id, level=level, paused=paused)
            logger.warning("stage %d is back (pid %s)", stage_id, client.pid)
            return

    def stop(self) -> None:
        """No more restarts; restarts in progress are cancelled."""
        self._stopped = True
        for task in list(self._tasks):
            task.cancel()

    async def wait_idle(self) -> None:
        """Wait until no restart is in progress (tests)."""
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
