"""The diffusion stage engine: batches image requests, and sleeps and wakes its weights.

Scheduling: requests wait in arrival order; a batch forms around the oldest waiting request,
of the waiting requests that can share its denoising loop (same size, steps, scheduler,
guidance), up to ``max_batch_size``. Up to ``max_active_batches`` batches are in flight at
once and take turns, one denoising step each per engine step, so a small request arriving
behind a large one starts at once and finishes in about its own time times the number of
batches in flight — no request waits for another's whole run. Aborts are handled between
steps: an aborted request leaves its batch at the next step, the others carry on. Limits
(``max_image_pixels``, ``max_inference_steps``) are checked in the API process before a
request is queued, so no single request can hold the stage for long.

A diffusion stage has no KV cache, so control is simpler than for an AR stage:

- ``pause(mode)`` gates scheduling only. "abort" ends every request (queued or running)
  with finish_reason "abort"; "wait" lets the requests already in the engine run to
  completion while new ones queue until ``resume()``; "keep" holds every request where it is
  — running batches keep their latents — and they continue after resume. Requests arriving
  while paused are queued either way.
- ``sleep(level, mode)`` pauses with ``mode`` (unless already paused) and releases the arena
  through the worker's ``SleepController``. Level 0 pauses only. With "keep", queued
  requests survive the sleep and run after wake.
- ``wake_up`` restores memory (level 2 reloads every component in place) and then resumes
  by itself: a diffusion stage needs no separate resume (see ``docs/control-plane.md``).
- Weights discarded and not reloaded: ``add_request`` raises ``WeightsInvalidError`` and
  ``step()`` never runs the model; queued requests wait for ``update_weights``.

A batch that fails fails its requests, not the stage; a process fault (out of memory, a
CUDA error) propagates and ends the process, which the server restarts.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import torch

from omnistage.config import StageConfig
from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    StageInternalError,
)
from omnistage.memory import Arena
from omnistage.stage.diffusion.denoise import DenoiseJob, batch_key
from omnistage.stage.diffusion.params import (
    MAX_SEED,
    DiffusionRequest,
    validate_request,
)
from omnistage.stage.diffusion.pipeline import ImagePipeline
from omnistage.stage.diffusion.worker import DiffusionWorker
from omnistage.stage.faults import is_process_fault
from omnistage.stage.messages import Ack, DiffusionStageInfo, DiffusionStageRequest
from omnistage.stage.sleep_args import check_level, check_mode
from omnistage.stage.sleep_control import SleepController, make_ack
from omnistage.stage.types import StageOutput
from omnistage.stage.weight_sync import WeightSync

logger = logging.getLogger(__name__)


def default_max_image_pixels(device: str) -> int:
    """Sized so that one request cannot hold the device for minutes."""
    return 512 * 512 if device == "cpu" else 2048 * 2048


class DiffusionStageEngine:
    """Serves one diffusers-format pipeline folder (``config.model``) on ``config.device``."""

    def __init__(self, config: StageConfig, *, load_weights: bool = True) -> None:
        if config.kind != "diffusion":
            raise ValueError(f"DiffusionStageEngine needs kind 'diffusion', got {config.kind!r}")
        self.config = config
        self.worker = DiffusionWorker(config, load_weights=load_weights)
        pipeline = self.pipeline
        self.limits = msgspec.structs.replace(
            pipeline.limits,
            native_size=pipeline.native_size,
            max_inference_steps=min(
                pipeline.limits.max_inference_steps, config.max_inference_steps
            ),
            max_image_pixels=config.max_image_pixels or default_max_image_pixels(config.device),
        )
        self._waiting: deque[DiffusionRequest] = deque()
        self._finished: list[StageOutput] = []  # delivered by the next step()
        self._pause_mode: str | None = None
        self._drain_ids: set[str] = set()  # mode "wait": requests that still run while paused
        self._asleep_at_level0 = False
        self._jobs: list[DenoiseJob] = []  # batches being denoised, a step at a time
        self.weight_version: str | None = None  # set by a trainer's weight sync
        self.weight_sync = WeightSync(
            self.stage_id, self.worker.weight_targets, self._apply_synced, self.arena.device
        )
        self.num_batches = 0
        self.last_batch_size = 0
        self.num_steps = 0

    @property
    def stage_id(self) -> int:
        return self.config.stage_id

    @property
    def pipeline(self) -> ImagePipeline:
        return self.worker.pipeline

    @property
    def arena(self) -> Arena:
        return self.worker.arena

    @property
    def sleep_control(self) -> SleepController:
        return self.worker.sleep_control

    def info(self) -> DiffusionStageInfo:
        """What the API process needs to validate requests before they reach this stage."""
        return DiffusionStageInfo(limits=self.limits)

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: DiffusionRequest) -> None:
        """Queue a request; raises ``StageAsleepError``, ``WeightsInvalidError`` or
        ``InvalidRequestError`` (naming the field) instead of queueing it."""
        if self.sleep_control.is_sleeping:
            raise StageAsleepError(self.stage_id)
        self.sleep_control.check_can_generate()
        validate_request(request, self.limits)
        queued = any(r.request_id == request.request_id for r in self._waiting)
        if queued or any(request.request_id in job.request_ids for job in self._jobs):
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued")
        self._waiting.append(request)

    def add_wire_request(self, request_id: str, request: object) -> None:
        """``add_request`` for a request that came over the wire (``DiffusionStageRequest``)."""
        if not isinstance(request, DiffusionStageRequest):
            raise InvalidRequestError(
                "request",
                f"a diffusion stage takes 'diffusion' requests, got {type(request).__name__}",
            )
        self.add_request(
            DiffusionRequest(
                request_id,
                prompt=request.prompt,
                prompt_embeds=request.prompt_embeds,
                negative_prompt_embeds=request.negative_prompt_embeds,
                params=request.params,
            )
        )

    def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort" (reported by the next step): a queued one,
        or one in a running batch, which the others of its batch finish without."""
        for request in list(self._waiting):
            if request.request_id == request_id:
                self._waiting.remove(request)
                self._finish_aborted(request)
        for job in list(self._jobs):
            dropped = job.drop(request_id)
            if dropped is not None:
                self._finish_aborted(dropped)
                if not job.items:
                    self._jobs.remove(job)

    def step(self) -> list[StageOutput]:
        """Deliver queued outputs, start a batch if there is room, then advance one batch by
        one denoising step (batches take turns)."""
        if self.sleep_control.weights_valid:  # asleep, or not reloaded: never run on garbage
            if len(self._jobs) < self.config.max_active_batches:
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
        """A batch around the oldest runnable request, of the requests that fit with it."""
        runnable = [r for r in self._waiting if self._may_run([r.request_id])]
        if not runnable:
            return
        key = batch_key(self.pipeline, runnable[0])
        batch = [r for r in runnable if batch_key(self.pipeline, r) == key]
        batch = batch[: self.config.max_batch_size]
        started = time.monotonic()
        for request in batch:
            self._waiting.remove(request)
            request.queue_time_s = started - request.arrival_time
        seeds = [
            r.params.seed if r.params.seed is not None else secrets.randbelow(MAX_SEED)
            for r in batch
        ]
        self.num_batches += 1
        self.last_batch_size = len(batch)
        try:
            self._jobs.append(DenoiseJob(self.pipeline, batch, seeds))
        except Exception as exc:
            self._fail(batch, exc)

    def _advance(self, job: DenoiseJob) -> None:
        self.num_steps += 1
        try:
            job.advance()
            if not job.is_done:
                return
            self._jobs.remove(job)
            for request, image in job.finish():
                self._drain_ids.discard(request.request_id)
                self._finished.append(
                    StageOutput(
                        request.request_id,
                        finished=True,
                        finish_reason="stop",
                        payload={"images": [image]},
                        queue_time_s=request.queue_time_s,
                    )
                )
        except Exception as exc:
            if job in self._jobs:
                self._jobs.remove(job)
            self._fail([item.request for item in job.items], exc)

    def _fail(self, batch: list[DiffusionRequest], exc: Exception) -> None:
        """A failed batch fails its requests, not the stage (a process fault propagates)."""
        if is_process_fault(exc):
            raise exc
        logger.exception("stage %d: a batch of %d requests failed", self.stage_id, len(batch))
        error = StageInternalError(f"{type(exc).__name__}: {exc}")
        for request in batch:
            self._drain_ids.discard(request.request_id)
            self._finished.append(
                StageOutput(request.request_id, finished=True, finish_reason="error", error=error)
            )

    def _finish_aborted(self, request: DiffusionRequest) -> None:
        self._drain_ids.discard(request.request_id)
        self._finished.append(StageOutput(request.request_id, finished=True, finish_reason="abort"))

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
        """Load a pipeline folder or a component-prefixed safetensors file in place
        (conventions in ``omnistage.stage.diffusion.pipeline``)."""
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
            "kind": "diffusion",
            "level": control.level,
            "is_sleeping": self.is_sleeping(),
            "sleeping_tags": control.sleeping_tags,
            "is_paused": self.is_paused,
            "pause_mode": self._pause_mode,
            "weights_valid": control.weights_valid,
            "weight_sources": control.weight_sources,
            "weight_version": self.weight_version,
            "num_waiting": len(self._waiting),
            "num_running": sum(len(job.items) for job in self._jobs),
            "num_active_batches": len(self._jobs),
            "num_batches": self.num_batches,
            "weight_bytes": self.pipeline.weight_bytes,
            "memory": control.memory_stats(),
        }

    def shutdown(self) -> None:
        """Drop queued requests and free the arena; the engine is unusable afterwards."""
        self._waiting.clear()
        self._finished.clear()
        self.worker.close()
