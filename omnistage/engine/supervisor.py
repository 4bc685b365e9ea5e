"""``Supervisor``: restarts a stage whose process died, as it was.

When a stage's process ends unasked, its requests have already failed (the stage client does
that at once). If the stage has restarts left in its budget (``max_restarts`` within
``window_s``), it is marked ``restarting`` — requests for it get 503 with Retry-After, other
stages keep serving — and a new process is started after a backoff (``backoff_s``, doubling
per recent restart, at most ``max_backoff_s``), with the same config, the weight updates the
stage had taken, and the sleep state it had: asleep at the same level (nothing is loaded that
the operator released), or paused. Out of budget, the stage is ``dead`` until the server
restarts.

Each death, restart attempt, failed restart and return is one log line with structured fields
(``stage_died``, ``stage_restarting``, ``stage_restart_failed``, ``stage_restarted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omnistage.engine import admission as adm
from omnistage.engine.stage_client import EngineStageClient
from omnistage.errors import StageStartupError
from omnistage.logs import log_event
from omnistage.stage.control import SYNC_PREFIX, Ack
from omnistage.stage.messages import StartupOptions

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
        names: Sequence[str] | None = None,
    ) -> None:
        self.clients = list(clients)
        self.gate = gate
        self.policy = policy or RestartPolicy()
        self.names = list(names) if names is not None else [c.kind for c in self.clients]
        self._died_at: list[float] = [0.0] * len(self.clients)
        self._recent: list[list[float]] = [[] for _ in self.clients]  # restart start times
        self._weight_sources: list[list[str]] = [[] for _ in self.clients]
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._replica_recent: dict[tuple[int, int], list[float]] = {}
        for client in self.clients:
            client.on_death(self._on_death)
            if hasattr(client, "on_replica_death"):
                client.on_replica_death(self._on_replica_death)

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

    def _fields(self, stage_id: int, **fields: Any) -> dict[str, Any]:
        return {"stage_id": stage_id, "stage": self.names[stage_id], **fields}

    def _log_death(self, stage_id: int, reason: str, level: int | None, restart: bool) -> None:
        client = self.clients[stage_id]
        # The exit code is known for a local process (a fake or a thread has none).
        code = getattr(client, "exit_code", None)
        sig = None
        if isinstance(code, int) and code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code).name
        name = f"stage {stage_id} ({self.names[stage_id]})"
        then = (
            "restarting it"
            if restart
            else f"no restarts left ({self.policy.max_restarts} within "
            f"{self.policy.window_s:g}s): it stays dead"
        )
        fields = self._fields(
            stage_id,
            pid=client.pid,
            reason=reason,
            exit_code=code,
            signal=sig,
            restarts=self.gate.stages[stage_id].restarts,
            max_restarts=self.policy.max_restarts,
            will_restart=restart,
            comes_back=(
                None if not restart else "awake" if level is None else f"asleep at level {level}"
            ),
        )
        log_event(logger, logging.ERROR, "stage_died", f"{name} died ({reason}); {then}", **fields)

    def _on_death(self, stage_id: int) -> bool:
        """On the event loop, before the client fails the stage's requests; whether the stage
        will be restarted."""
        reason = self.clients[stage_id].death_reason
        self._died_at[stage_id] = time.monotonic()
        level = self.gate.restart_level(stage_id)
        if any(s.startswith(SYNC_PREFIX) for s in self._weight_sources[stage_id]):
            # Weights a trainer pushed left with the process: come back without any, for
            # the trainer to push again (a wake with reload=false), never with stale ones.
            level = 2
        paused = self.gate.stages[stage_id].paused
        restart = self._budget_left(stage_id)
        self._log_death(stage_id, reason, level, restart)
        self.gate.mark_dead(stage_id, reason, restarting=restart)
        if not restart:
            return False
        task = asyncio.get_running_loop().create_task(self._restart(stage_id, level, paused))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

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
            state = "awake" if level is None else f"asleep at level {level}"
            name = f"stage {stage_id} ({self.names[stage_id]})"
            log_event(
                logger,
                logging.INFO,
                "stage_restarting",
                f"restarting {name} (attempt {attempt}, {state})",
                **self._fields(stage_id, attempt=attempt, backoff_s=delay, comes_back=state),
            )
            started = time.monotonic()
            try:
                await client.restart(options)
            except (StageStartupError, OSError) as exc:
                retry = self._budget_left(stage_id)
                log_event(
                    logger,
                    logging.ERROR,
                    "stage_restart_failed",
                    f"{name} failed to restart",
                    **self._fields(stage_id, attempt=attempt, error=str(exc), will_retry=retry),
                )
                if retry:
                    continue
                self.gate.mark_dead(stage_id, f"restart failed: {exc}", restarting=False)
                return
            self.gate.mark_restarted(stage_id, level=level, paused=paused)
            now = time.monotonic()
            fields = self._fields(
                stage_id,
                pid=client.pid,
                restarts=self.gate.stages[stage_id].restarts,
                attempt=attempt,
                state=state,
                sleep_level=level,
                paused=paused,
                startup_ms=round((now - started) * 1e3, 1),
                down_ms=round((now - self._died_at[stage_id]) * 1e3, 1),
            )
            message = f"{name} is back (pid {client.pid}, {state})"
            log_event(logger, logging.INFO, "stage_restarted", message, **fields)
            return

    # -- one replica of a stage that serves on ---------------------------------------------

    def _on_replica_death(self, stage_id: int, replica_id: int) -> bool:
        """A replica died while another of its stage lives: the stage serves on (the gate is
        not told); the replica comes back on its own budget, as it was (awake or asleep),
        with the stage's weight updates."""
        client: Any = self.clients[stage_id]
        replica = client.replicas[replica_id]
        now = time.monotonic()
        recent = [
            t
            for t in self._replica_recent.get((stage_id, replica_id), [])
            if now - t < self.policy.window_s
        ]
        self._replica_recent[(stage_id, replica_id)] = recent
        restart = not self._stopped and len(recent) < self.policy.max_restarts
        level = client.levels[replica_id] if client.states[replica_id] != "awake" else None
        if any(s.startswith(SYNC_PREFIX) for s in self._weight_sources[stage_id]):
            level = 2  # pushed weights left with it (see _on_death)
        name = f"stage {stage_id} ({self.names[stage_id]}) replica {replica_id}"
        then = "restarting it; the other replicas serve on" if restart else "it stays dead"
        log_event(
            logger, logging.ERROR, "stage_died",
            f"{name} died ({replica.death_reason}); {then}",
            **self._fields(stage_id, replica_id=replica_id, pid=replica.pid,
                           reason=replica.death_reason, exit_code=replica.exit_code,
                           will_restart=restart),
        )  # fmt: skip
        if not restart:
            return False
        client.restarting.add(replica_id)
        task = asyncio.get_running_loop().create_task(
            self._restart_replica(stage_id, replica_id, level)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _restart_replica(self, stage_id: int, replica_id: int, level: int | None) -> None:
        client: Any = self.clients[stage_id]
        name = f"stage {stage_id} ({self.names[stage_id]}) replica {replica_id}"
        recent = self._replica_recent[(stage_id, replica_id)]
        try:
            while True:
                recent.append(time.monotonic())
                attempt = len(recent)
                await asyncio.sleep(
                    min(self.policy.backoff_s * 2 ** (attempt - 1), self.policy.max_backoff_s)
                )
                options = StartupOptions(
                    sleep_level=level, weight_sources=self._weight_sources[stage_id]
                )
                started = time.monotonic()
                try:
                    await client.restart_replica(replica_id, options)
                except (StageStartupError, OSError) as exc:
                    retry = not self._stopped and len(recent) < self.policy.max_restarts
                    log_event(
                        logger, logging.ERROR, "stage_restart_failed",
                        f"{name} failed to restart",
                        **self._fields(stage_id, replica_id=replica_id, attempt=attempt,
                                       error=str(exc), will_retry=retry),
                    )  # fmt: skip
                    if retry:
                        continue
                    return
                state = "awake" if level is None else f"asleep at level {level}"
                log_event(
                    logger, logging.INFO, "stage_restarted",
                    f"{name} is back (pid {client.replicas[replica_id].pid}, {state})",
                    **self._fields(stage_id, replica_id=replica_id, attempt=attempt,
                                   state=state,
                                   startup_ms=round((time.monotonic() - started) * 1e3, 1)),
                )  # fmt: skip
                return
        finally:
            client.restarting.discard(replica_id)

    def stop(self) -> None:
        """No more restarts; restarts in progress are cancelled."""
        self._stopped = True
        for task in list(self._tasks):
            task.cancel()

    async def wait_idle(self) -> None:
        """Wait until no restart is in progress (tests)."""
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
