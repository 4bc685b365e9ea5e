"""The diffusion stage engine: batches image requests, and sleeps and wakes its weights.

A diffusion stage has no KV cache, so control is simpler than for an AR stage:

- ``pause(mode)`` gates scheduling only. "abort" ends every waiting request with
  finish_reason "abort"; "wait" lets the requests already in the engine run to completion
  while new ones queue until ``resume()``; "keep" holds every request in the queue and they
  run after resume. Requests arriving while paused are queued either way.
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
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from omnistage.config import StageConfig
from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    StageInternalError,
)
from omnistage.memory import Arena
from omnistage.stage.diffusion.denoise import batch_key, conditioning, denoise_batch
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
        self.num_batches = 0
        self.last_batch_size = 0

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
        if any(r.request_id == request.request_id for r in self._waiting):
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
        """End a queued request with finish_reason "abort" (reported by the next step)."""
        for request in list(self._waiting):
            if request.request_id == request_id:
                self._waiting.remove(request)
                self._finish_aborted(request)

    def step(self) -> list[StageOutput]:
        """Deliver queued outputs, then denoise one batch if anything may run."""
        outputs, self._finished = self._finished, []
        batch = self._next_batch()
        if batch:
            outputs += self._run(batch)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._finished)

    def _may_run(self, request: DiffusionRequest) -> bool:
        return self._pause_mode is None or request.request_id in self._drain_ids

    def _next_batch(self) -> list[DiffusionRequest]:
        if not self.sleep_control.weights_valid:
            return []  # asleep, or discarded and not reloaded: never run on garbage
        runnable = [r for r in self._waiting if self._may_run(r)]
        if not runnable:
            return []
        key = batch_key(self.pipeline, runnable[0])
        batch = [r for r in runnable if batch_key(self.pipeline, r) == key]
        batch = batch[: self.config.max_batch_size]
        for request in batch:
            self._waiting.remove(request)
        return batch

    def _run(self, batch: list[DiffusionRequest]) -> list[StageOutput]:
        seeds = [
            r.params.seed if r.params.seed is not None else secrets.randbelow(MAX_SEED)
            for r in batch
        ]
        self.num_batches += 1
        self.last_batch_size = len(batch)
        self._drain_ids.difference_update(r.request_id for r in batch)
        try:
            conds = [conditioning(self.pipeline, r) for r in batch]
            images = denoise_batch(self.pipeline, batch, seeds, conds)
        except Exception as exc:  # a failed batch fails its requests, not the stage
            if is_process_fault(exc):
                raise
            logger.exception("diffusion batch failed")
            error = StageInternalError(f"{type(exc).__name__}: {exc}")
            return [
                StageOutput(r.request_id, finished=True, finish_reason="error", error=error)
                for r in batch
            ]
        return [
            StageOutput(
                r.request_id, finished=True, finish_reason="stop", payload={"images": [image]}
            )
            for r, image in zip(batch, images, strict=True)
        ]

    def _finish_aborted(self, request: DiffusionRequest) -> None:
        self._drain_ids.discard(request.request_id)
        self._finished.append(StageOutput(request.request_id, finished=True, finish_reason="abort"))

    # -- pause / resume -------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> int:
        """Stop scheduling (see the module docstring); returns the number of aborted requests."""
        check_mode(mode)
        self._pause_mode = mode
        self._drain_ids = {r.request_id for r in self._waiting} if mode == "wait" else set()
        if mode != "abort":
            return 0
        aborted = list(self._waiting)
        self._waiting.clear()
        for request in aborted:
            self._finish_aborted(request)
        return len(aborted)

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
            "num_waiting": len(self._waiting),
            "num_running": 0,  # batches run to completion inside step()
            "num_batches": self.num_batches,
            "weight_bytes": self.pipeline.weight_bytes,
            "memory": control.memory_stats(),
        }

    def shutdown(self) -> None:
        """Drop queued requests and free the arena; the engine is unusable afterwards."""
        self._waiting.clear()
        self._finished.clear()
        self.worker.close()
