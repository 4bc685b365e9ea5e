"""Step-scheduled stage engines: requests run as jobs that advance one step per engine step.

Shared by the stage kinds that keep no KV cache: a diffusion stage (a job is a batch of images
denoised a step at a time) and a code2wav stage (a job is one utterance, solved an ODE step at
a time). A kind says how waiting requests form a job (``_take_job``, ``_make_job``), checks its
own requests (``_check_request``) and names its payload; everything else lives here, the same
for every kind:

Scheduling: requests wait in arrival order; while fewer than ``max_active_jobs`` jobs are in
flight, each engine step starts one around the oldest runnable request. The jobs take turns,
one step each per engine step, so a small request arriving behind a large one starts at once
and finishes in about its own time times the number of jobs in flight — no request waits for
another's whole run. Aborts are handled between steps: an aborted request leaves its job at
the next step, the others of the job carry on.

Control (no KV cache, so simpler than an AR stage's):

- ``pause(mode)`` gates scheduling only. "abort" ends every request (queued or running)
  with finish_reason "abort"; "wait" lets the requests already in the engine run to
  completion while new ones queue until ``resume()``; "keep" holds every request where it is
  — running jobs keep their state — and they continue after resume. Requests arriving
  while paused are queued either way.
- ``sleep(level, mode)`` pauses with ``mode`` (unless already paused) and releases the arena
  through the worker's ``SleepController``. Level 0 pauses only. With "keep", queued and
  running requests survive the sleep and continue after wake.
- ``wake_up`` restores memory (level 2 reloads the weights in place) and then resumes by
  itself: these stages need no separate resume (see ``docs/control-plane.md``).
- Weights discarded and not reloaded: ``add_request`` raises ``WeightsInvalidError`` and
  ``step()`` never runs the model; queued requests wait for ``update_weights``.

A job that fails fails its requests, not the stage; a process fault (out of memory, a CUDA
error) propagates and ends the process, which the server restarts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from omnistage.config import StageConfig
from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    StageInternalError,
)
from omnistage.memory import Arena
from omnistage.stage.faults import is_process_fault
from omnistage.stage.messages import Ack
from omnistage.stage.sleep_args import check_level, check_mode
from omnistage.stage.sleep_control import SleepController, make_ack
from omnistage.stage.types import StageOutput
from omnistage.stage.weight_sync import WeightSync

logger = logging.getLogger(__name__)


class QueuedRequest(Protocol):
    """What the scheduler needs of a request: its id and its timing."""

    request_id: str
    arrival_time: float
    queue_time_s: float | None


class StepJob(Protocol):
    """Requests run together, one step per ``advance``; ``finish`` hands back one
    ``(request, output)`` per request once ``is_done``."""

    @property
    def request_ids(self) -> list[str]: ...

    @property
    def is_done(self) -> bool: ...

    def advance(self) -> None: ...

    def drop(self, request_id: str) -> Any:
        """Take a request out (abort): the request, or None if it is not in the job."""
        ...

    def finish(self) -> Sequence[tuple[Any, Any]]: ...


class StageWorker(Protocol):
    """What one rank owns: its arena, the weights in it and their sleep controller."""

    arena: Arena
    sleep_control: SleepController

    def weight_targets(self) -> dict[str, torch.Tensor]: ...
    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: object) -> Ack: ...
    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack: ...
    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack: ...
    def close(self) -> None: ...


R = TypeVar("R", bound=QueuedRequest)


class JobEngine(Generic[R]):
    """The engine of a step-scheduled stage kind; subclasses fill in the kind's part."""

    payload_key: ClassVar[str]  # a finished request's payload: {payload_key: [output]}

    def __init__(self, config: StageConfig, worker: StageWorker) -> None:
        self.config = config
        self.worker = worker
        self._waiting: deque[R] = deque()
        self._finished: list[StageOutput] = []  # delivered by the next step()
        self._pause_mode: str | None = None
        self._drain_ids: set[str] = set()  # mode "wait": requests that still run while paused
        self._asleep_at_level0 = False
        self._jobs: list[StepJob] = []  # jobs in flight, a step at a time
        self.weight_version: str | None = None  # set by a trainer's weight sync
        self.weight_sync = WeightSync(
            self.stage_id, self.worker.weight_targets, self._apply_synced, self.arena.device
        )
        self.num_jobs = 0
        self.last_job_size = 0
        self.num_steps = 0

    # -- the kind's part ------------------------------------------------------------------

    @property
    def max_active_jobs(self) -> int:
        raise NotImplementedError

    def _check_request(self, request: R) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field of ``request``."""
        raise NotImplementedError

    def _take_job(self, runnable: list[R]) -> list[R]:
        """The requests of the next job: the oldest runnable one and those that fit with it."""
        return runnable[:1]

    def _make_job(self, requests: list[R]) -> StepJob:
        raise NotImplementedError

    def _status_fields(self) -> dict[str, Any]:
        return {}

    # -- shared state ---------------------------------------------------------------------

    @property
    def stage_id(self) -> int:
        return self.config.stage_id

    @property
    def arena(self) -> Arena:
        return self.worker.arena

    @property
    def sleep_control(self) -> SleepController:
        return self.worker.sleep_control

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: R) -> None:
        """Queue a request; raises ``StageAsleepError``, ``WeightsInvalidError`` or
        ``InvalidRequestError`` (naming the field) instead of queueing it."""
        if self.sleep_control.is_sleeping:
            raise StageAsleepError(self.stage_id)
        self.sleep_control.check_can_generate()
        self._check_request(request)
        queued = any(r.request_id == request.request_id for r in self._waiting)
        if queued or any(request.request_id in job.request_ids for job in self._jobs):
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued")
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort" (reported by the next step): a queued one,
        or one in a running job, which the others of its job finish without."""
        for request in list(self._waiting):
            if request.request_id == request_id:
                self._waiting.remove(request)
                self._finish_aborted(request_id)
        for job in list(self._jobs):
            if job.drop(request_id) is not None:
                self._finish_aborted(request_id)
                if not job.request_ids:
                    self._jobs.remove(job)

    def step(self) -> list[StageOutput]:
        """Deliver queued outputs, start a job if there is room, then advance one job by one
        step (jobs take turns)."""
        if self.sleep_control.weights_valid:  # asleep, or not reloaded: never run on garbage
            if len(self._jobs) < self.max_active_jobs:
                self._start_job()
            runnable = [job for job in self._jobs if self._may_run(job.request_ids)]
            if runnable:
                self._advance(runnable[self.num_steps % len(runnable)])
        outputs, self._finished = self._finished, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._jobs or self._finished)

    def has_runnable_work(self) -> bool:
        """Whether ``step()`` would make progress now (the stage loop does not wait then)."""
        if self._finished:
            return True
        if not self.sleep_control.weights_valid:
            return False
        return any(self._may_run(job.request_ids) for job in self._jobs) or any(
            self._may_run([r.request_id]) for r in self._waiting
        )

    def _may_run(self, request_ids: list[str]) -> bool:
        if self._pause_mode is None:
            return True
        return self._pause_mode == "wait" and all(r in self._drain_ids for r in request_ids)

    def _start_job(self) -> None:
        runnable = [r for r in self._waiting if self._may_run([r.request_id])]
        if not runnable:
            return
        requests = self._take_job(runnable)
        started = time.monotonic()
        for request in requests:
            self._waiting.remove(request)
            request.queue_time_s = started - request.arrival_time
        self.num_jobs += 1
        self.last_job_size = len(requests)
        try:
            self._jobs.append(self._make_job(requests))
        except Exception as exc:
            self._fail([r.request_id for r in requests], exc)

    def _advance(self, job: StepJob) -> None:
        self.num_steps += 1
        try:
            job.advance()
            if not job.is_done:
                return
            self._jobs.remove(job)
            for request, output in job.finish():
                self._drain_ids.discard(request.request_id)
                self._finished.append(
                    StageOutput(
                        request.request_id,
                        finished=True,
                        finish_reason="stop",
                        payload={self.payload_key: [output]},
                        queue_time_s=request.queue_time_s,
                    )
                )
        except Exception as exc:
            if job in self._jobs:
                self._jobs.remove(job)
            self._fail(job.request_ids, exc)

    def _fail(self, request_ids: list[str], exc: Exception) -> None:
        """A failed job fails its requests, not the stage (a process fault propagates)."""
        if is_process_fault(exc):
            raise exc
        logger.exception("stage %d: a job of %d requests failed", self.stage_id, len(request_ids))
        error = StageInternalError(f"{type(exc).__name__}: {exc}")
        for request_id in request_ids:
            self._drain_ids.discard(request_id)
            self._finished.append(
                StageOutput(request_id, finished=True, finish_reason="error", error=error)
            )

    def _finish_aborted(self, request_id: str) -> None:
        self._drain_ids.discard(request_id)
        self._finished.append(StageOutput(request_id, finished=True, finish_reason="abort"))

    # -- pause / resume -------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> int:
        """Stop scheduling (see the module docstring); returns the number of aborted requests."""
        check_mode(mode)
        self._pause_mode = mode
        running = [r for job in self._jobs for r in job.request_ids]
        queued = [r.request_id for r in self._waiting]
        self._drain_ids = set(running + queued) if mode == "wait" else set()
        if mode != "abort":
            return 0
        for request_id in running + queued:
            self.abort(request_id)
        return len(running) + len(queued)

    def resume(self) -> None:
        self._pause_mode = None
        self._drain_ids.clear()

    def is_drained(self) -> bool:
        """True once every request that was in the engine at ``pause("wait")`` has finished."""
        return not self._drain_ids

    # -- sleep / wake / weights -----------------------------------------------------------

    def _require_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError(self.stage_id)

    def sleep(self, level: int = 2, mode: str = "abort", tags: list[str] | None = None) -> Ack:
        """Pause with ``mode`` (unless paused), then release memory for ``level``.

        Mode "wait" raises ``RuntimeError`` while requests are still draining: the caller
        drives ``step()`` until ``is_drained()`` (bounded by ``drain_timeout_s``) and retries.
        """
        self._require_sleep_mode()
        check_level(level)
        check_mode(mode)
        unknown = sorted(set(tags or ()) - set(self.arena.tags))
        if unknown:  # checked before pausing: a refused sleep must not abort requests
            raise InvalidRequestError(
                "tags", f"unknown tags {unknown}; this stage has {self.arena.tags}"
            )
        aborted = 0 if self.is_paused else self.pause(mode)
        if mode == "wait" and not self.is_drained():
            raise RuntimeError(
                f"stage {self.stage_id}: {len(self._drain_ids)} requests still draining; call "
                "step() until is_drained() (bounded by drain_timeout_s), then sleep again"
            )
        ack = self.worker.sleep(level, tags, mode=mode, aborted=aborted, preempted=0)
        if level == 0:
            self._asleep_at_level0 = True
        return ack

    def wake_up(self, tags: list[str] | None = None, reload: bool = True) -> Ack:
        """Map memory back (reloading discarded weights unless ``reload`` is False) and
        resume admission once nothing is asleep."""
        self._require_sleep_mode()
        if self._asleep_at_level0 and not self.sleep_control.is_sleeping:
            self._asleep_at_level0 = False
            self.resume()
            return make_ack(self.stage_id, level=0, weights_valid=self.sleep_control.weights_valid)
        ack = self.worker.wake_up(tags, reload)
        if ack.status == "SUCCESS" and not self.sleep_control.is_sleeping:
            self._asleep_at_level0 = False
            self.resume()
        return ack

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        """Load a weight source in place (its conventions: the kind's pipeline module)."""
        return self.worker.update_weights(path, check_finite=check_finite)

    def _apply_synced(self, tensors: dict[str, torch.Tensor], version: str) -> Ack:
        ack = self.sleep_control.apply_synced(tensors, self.worker.weight_targets, version)
        self.weight_version = version
        return ack

    def is_sleeping(self) -> bool:
        return self.sleep_control.is_sleeping or self._asleep_at_level0

    def status(self) -> dict[str, Any]:
        control = self.sleep_control
        return {
            "stage_id": self.stage_id,
            "kind": self.config.kind,
            "level": control.level,
            "is_sleeping": self.is_sleeping(),
            "sleeping_tags": control.sleeping_tags,
            "is_paused": self.is_paused,
            "pause_mode": self._pause_mode,
            "weights_valid": control.weights_valid,
            "weight_sources": control.weight_sources,
            "weight_version": self.weight_version,
            "num_waiting": len(self._waiting),
            "num_running": sum(len(job.request_ids) for job in self._jobs),
            **self._status_fields(),
            "memory": control.memory_stats(),
        }

    def shutdown(self) -> None:
        """Drop queued requests and free the arena; the engine is unusable afterwards."""
        self._waiting.clear()
        self._finished.clear()
        self.worker.close()
