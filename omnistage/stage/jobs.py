"""Step-scheduled stage engines: requests run as jobs that advance one step per engine step.

Shared by the stage kinds that keep no KV cache: a diffusion stage (a job is a batch of images
denoised a step at a time) and a code2wav stage (a job is one utterance, solved a step at a
time). A kind says how waiting requests form a job (``_take_job``, ``_make_job``), checks its
own requests (``_check_request``) and names its payload; the rest lives here: requests wait in
arrival order, up to ``max_active_jobs`` jobs take turns a step each (a small request behind a
large one starts at once), ``step_threads`` groups of jobs step at once on threads of their
own, aborts leave a job between steps, a failing job fails its requests and not the stage, and
a streamed job may wait for input (``is_ready``) and hand out results early
(``take_partial``). Control is every engine's (``engine_base``): with "keep", queued and
running jobs survive a sleep. The why of each rule: ``docs/design.md``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError, StageAsleepError, StageInternalError
from omnistage.stage.engine_base import StageEngineBase, W
from omnistage.stage.faults import is_process_fault
from omnistage.stage.types import StageOutput

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


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _is_ready(job: StepJob) -> bool:
    """Whether a job can step now (one fed a streamed input may wait for more)."""
    return bool(getattr(job, "is_ready", True))


R = TypeVar("R", bound=QueuedRequest)


class JobEngine(StageEngineBase[W], Generic[W, R]):
    """The engine of a step-scheduled stage kind; subclasses fill in the kind's part."""

    resumes_after_wake: ClassVar[bool] = True

    def __init__(self, config: StageConfig, worker: W) -> None:
        super().__init__(config, worker)
        self._waiting: deque[R] = deque()
        self._finished: list[StageOutput] = []  # delivered by the next step()
        self._drain_ids: set[str] = set()  # mode "wait": requests that still run while paused
        self._jobs: list[StepJob] = []  # jobs in flight, a step at a time
        self.num_jobs = 0
        self.last_job_size = 0
        self.num_steps = 0
        self.num_batched_steps = 0  # steps several jobs took together
        self._threads: ThreadPoolExecutor | None = None  # step_threads > 1: the other groups'
        self._torch_threads = _torch_threads()  # the stage's, set before its engine is built

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

    @property
    def max_job_size(self) -> int:
        """Most requests one job takes (a kind that batches says more)."""
        return 1

    @property
    def batch_wait_s(self) -> float:
        """How long a job with room waits for requests arriving with its oldest (0: none)."""
        return 0.0

    def _make_job(self, requests: list[R]) -> StepJob:
        raise NotImplementedError

    def _status_fields(self) -> dict[str, Any]:
        return {}

    def _companions(self, job: StepJob, runnable: list[StepJob]) -> list[StepJob]:
        """Jobs that take their next step together with ``job`` (a kind that batches steps
        of separate jobs says which; by default none)."""
        return []

    def _advance_together(self, jobs: list[StepJob]) -> None:
        """One step of each of ``jobs`` at once (for the kinds whose ``_companions`` may
        name some)."""
        for job in jobs:
            job.advance()

    def _append(self, request_id: str, token_ids: list[int], final: bool) -> bool:
        """Give a streamed request more input (queued or in its job); False if it is not
        here. Kinds that take streamed input implement it."""
        raise InvalidRequestError("stream", "this stage kind takes no streamed input")

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

    def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        """More input for a streamed request (dropped if the request has ended)."""
        self._append(request_id, token_ids, final)

    def fail_request(self, request_id: str, exc: Exception) -> None:
        """End a request with ``exc`` (its streamed input was refused)."""
        for request in list(self._waiting):
            if request.request_id == request_id:
                self._waiting.remove(request)
        for job in list(self._jobs):
            if job.drop(request_id) is not None and not job.request_ids:
                self._jobs.remove(job)
        self._drain_ids.discard(request_id)
        self._finished.append(
            StageOutput(request_id, finished=True, finish_reason="error", error=exc)
        )

    def step(self) -> list[StageOutput]:
        """Deliver queued outputs, start a job if there is room, then advance the job whose
        turn it is (with its companions) by one step, and with ``step_threads`` > 1 more
        groups beside it on threads of their own (jobs take turns)."""
        if self.sleep_control.weights_valid:  # asleep, or not reloaded: never run on garbage
            if len(self._jobs) < self.max_active_jobs:
                self._start_job()
            runnable = [
                job for job in self._jobs if _is_ready(job) and self._may_run(job.request_ids)
            ]
            if runnable:
                self._advance_groups(self._groups(runnable))
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
        if len(self._jobs) < self.max_active_jobs and any(
            self._may_run([r.request_id]) for r in self._waiting
        ):
            return True
        return any(_is_ready(job) and self._may_run(job.request_ids) for job in self._jobs)

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
        if len(requests) < self.max_job_size and started - requests[0].arrival_time < (
            self.batch_wait_s
        ):
            return  # concurrent requests arrive a few ms apart: let them share the batch
        for request in requests:
            self._waiting.remove(request)
            request.queue_time_s = started - request.arrival_time
        self.num_jobs += 1
        self.last_job_size = len(requests)
        try:
            self._jobs.append(self._make_job(requests))
        except Exception as exc:
            self._fail([r.request_id for r in requests], exc)

    def _groups(self, runnable: list[StepJob]) -> list[list[StepJob]]:
        """This step's groups: the job whose turn it is with its companions and, with
        ``step_threads`` > 1, as many more groups of the other runnable jobs as there are
        threads (the largest group halved while there are fewer: a second core gains more
        than a wider batch)."""
        turn = self.num_steps % len(runnable)
        order = runnable[turn:] + runnable[:turn]
        groups: list[list[StepJob]] = []
        while order and len(groups) < self.config.step_threads:
            group = [order[0], *self._companions(order[0], order[1:])]
            order = [job for job in order if job not in group]
            groups.append(group)
        while len(groups) < self.config.step_threads:
            largest = max(groups, key=len)
            if len(largest) < 2:
                break
            half = len(largest) // 2
            groups.remove(largest)
            groups += [largest[:half], largest[half:]]
        return groups

    def _advance_groups(self, groups: list[list[StepJob]]) -> None:
        """One step of each group, the groups on threads of their own when there are several
        (each job's step is its own: what it computes does not depend on the others); the
        outcomes are then handled here, in order."""
        if len(groups) > 1 and self._threads is None:
            import torch

            # a new thread takes OpenMP's default (every core) until told: the stage's count
            self._threads = ThreadPoolExecutor(
                self.config.step_threads - 1,
                thread_name_prefix=f"stage{self.stage_id}-step",
                initializer=torch.set_num_threads,
                initargs=(self._torch_threads,),
            )
        futures = [self._threads.submit(self._run, g) for g in groups[1:]] if self._threads else []
        errors = [self._run(groups[0]), *(future.result() for future in futures)]
        for group, error in zip(groups, errors, strict=True):
            self._settle(group, error)

    def _run(self, jobs: list[StepJob]) -> Exception | None:
        """One step of ``jobs``, on whichever thread; the exception it raised, if any."""
        try:
            if len(jobs) == 1:
                jobs[0].advance()
            else:
                self._advance_together(jobs)
        except Exception as exc:
            return exc
        return None

    def _settle(self, jobs: list[StepJob], error: Exception | None) -> None:
        self.num_steps += 1
        self.num_batched_steps += int(len(jobs) > 1)
        if error is not None:
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
            self._fail([r for job in jobs for r in job.request_ids], error)
            return
        for job in jobs:
            self._after_step(job)

    def _after_step(self, job: StepJob) -> None:
        """Hand out what a stepped job has ready: partial results, or its outputs when done."""
        try:
            for request, media in getattr(job, "take_partial", list)():
                self._finished.append(StageOutput(request.request_id, media=[media]))
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
                        media=[output],
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

    # -- control: the kind's part of ``StageEngineBase`` ----------------------------------

    def _pause_requests(self, mode: str) -> tuple[int, int]:
        running = [r for job in self._jobs for r in job.request_ids]
        queued = [r.request_id for r in self._waiting]
        self._drain_ids = set(running + queued) if mode == "wait" else set()
        if mode != "abort":
            return 0, 0
        for request_id in running + queued:
            self.abort(request_id)
        return len(running) + len(queued), 0

    def _resume_requests(self) -> None:
        self._drain_ids.clear()

    def is_drained(self) -> bool:
        return not self._drain_ids

    def drain_holders(self) -> list[str]:
        """The requests ``is_drained`` still waits for (a ``wait`` sleep's error names them)."""
        return sorted(self._drain_ids)

    def status(self) -> dict[str, Any]:
        return {
            **self.control_status(),
            "num_waiting": len(self._waiting),
            "num_running": sum(len(job.request_ids) for job in self._jobs),
            **self._status_fields(),
            "memory": self.memory_stats(),
        }

    def shutdown(self) -> None:
        """Drop queued requests and free the arena; the engine is unusable afterwards."""
        self._waiting.clear()
        self._finished.clear()
        if self._threads is not None:
            self._threads.shutdown()
        self.worker.close()
