"""The diffusion stage engine: batches image and video requests, and sleeps and wakes its
weights.

Scheduling, control and weights are the step-scheduled engine's (``omnistage.stage.jobs``);
a job here is a batch: it forms around the oldest waiting request, of the waiting requests
that can share its denoising loop (same size, steps, scheduler, guidance), up to
``max_batch_size``. Up to ``max_active_batches`` batches are in flight at once and take
turns, one denoising step each per engine step. Limits (``max_image_pixels``,
``max_inference_steps``) are checked in the API process before a request is queued, so no
single request can hold the stage for long.
"""

from __future__ import annotations

import secrets
from typing import Any

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.stage.diffusion.denoise import DenoiseJob, batch_key
from omnistage.stage.diffusion.params import (
    MAX_EMBEDDING_TOKENS,
    MAX_IMAGE_SIDE,
    MAX_SEED,
    DiffusionRequest,
    PipelineLimits,
    resolve_params,
    validate_request,
)
from omnistage.stage.diffusion.wire import DiffusionStageInfo, DiffusionStageRequest
from omnistage.stage.diffusion.worker import DiffusionWorker
from omnistage.stage.jobs import JobEngine, StepJob


def default_max_image_pixels(device: str) -> int:
    """Sized so that one request cannot hold the device for minutes."""
    return 512 * 512 if device == "cpu" else 2048 * 2048


class DiffusionStageEngine(JobEngine[DiffusionWorker, DiffusionRequest]):
    """Serves one diffusers-format pipeline folder (``config.model``) on ``config.device``,
    through the model family the registry finds for it (``worker.family``)."""

    def __init__(self, config: StageConfig, *, load_weights: bool = True) -> None:
        if config.kind != "diffusion":
            raise ValueError(f"DiffusionStageEngine needs kind 'diffusion', got {config.kind!r}")
        super().__init__(config, DiffusionWorker(config, load_weights=load_weights))
        own = self.family.limits(self.pipeline)
        self.limits = PipelineLimits(
            size_multiple=own.size_multiple,
            embedding_dim=own.embedding_dim,
            has_text_encoder=own.has_text_encoder,
            native_size=own.native_size,
            max_inference_steps=min(own.max_inference_steps, config.diffusion.max_inference_steps),
            max_image_pixels=config.diffusion.max_image_pixels
            or default_max_image_pixels(config.device),
            takes_prompt_embeds=own.takes_prompt_embeds,
            takes_negative_prompt=own.takes_negative_prompt,
            takes_scheduler_override=own.takes_scheduler_override,
            max_sequence_length=min(own.max_sequence_length, MAX_EMBEDDING_TOKENS),
            max_frames=own.max_frames,
            frame_step=own.frame_step,
            default_frames=own.default_frames,
            default_fps=own.default_fps,
            native_width=own.native_width,
            default_guidance_scale=own.default_guidance_scale,
            family=self.pipeline.class_name,
            max_side=own.max_side or MAX_IMAGE_SIDE,
            scheduler_options=tuple(
                o for o in ("flow_shift",) if o in self.pipeline.scheduler_config
            ),
            param_aliases=dict(own.param_aliases),
        )

    @property
    def family(self) -> Any:
        """The model family serving the folder (``registry.family_of_folder``)."""
        return self.worker.family

    @property
    def pipeline(self) -> Any:
        """The family's loaded pipeline: ``modules``, ``weight_bytes``, scheduler config."""
        return self.worker.pipeline

    @property
    def num_batches(self) -> int:
        return self.num_jobs

    @property
    def last_batch_size(self) -> int:
        return self.last_job_size

    @property
    def max_active_jobs(self) -> int:
        return self.config.diffusion.max_active_batches

    @property
    def max_job_size(self) -> int:
        return self.config.diffusion.max_batch_size

    @property
    def batch_wait_s(self) -> float:
        return self.config.diffusion.batch_wait_ms / 1e3

    def info(self) -> DiffusionStageInfo:
        """What the API process needs to validate requests before they reach this stage."""
        return DiffusionStageInfo(limits=self.limits)

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

    def _check_request(self, request: DiffusionRequest) -> None:
        validate_request(request, self.limits)
        request.params = resolve_params(request.params, self.limits)

    def _take_job(self, runnable: list[DiffusionRequest]) -> list[DiffusionRequest]:
        """A batch around the oldest runnable request, of the requests that fit with it."""
        key = batch_key(self.family, self.pipeline, runnable[0])
        batch = [r for r in runnable if batch_key(self.family, self.pipeline, r) == key]
        return batch[: self.config.diffusion.max_batch_size]

    def _make_job(self, requests: list[DiffusionRequest]) -> StepJob:
        seeds = [
            r.params.seed if r.params.seed is not None else secrets.randbelow(MAX_SEED)
            for r in requests
        ]
        return DenoiseJob(self.family, self.pipeline, requests, seeds)

    def _status_fields(self) -> dict[str, Any]:
        return {
            "num_active_batches": len(self._jobs),
            "num_batches": self.num_jobs,
            "weight_bytes": self.pipeline.weight_bytes,
        }
