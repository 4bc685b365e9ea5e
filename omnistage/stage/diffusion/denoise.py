"""The denoising loop, one step at a time, for any diffusion family.

A ``DenoiseJob`` is a batch of compatible requests (one ``batch_key``: the family's key — image
size, steps, guidance — and the scheduler class) that ``advance()`` moves one denoising step:
one call of the family's denoiser for the whole batch, then each request's own scheduler step.
The engine interleaves the steps of several jobs and checks for aborts between them, so a
large request never holds the stage for its whole run, and an aborted request leaves its
batch at the next step.

Per request: its conditioning (the family's ``encode``), its own scheduler instance with its
timesteps (the family's ``set_timesteps``), its own latents drawn from its seed (the family's
``prepare_latents``) and its own guidance scale. The scheduler's update is elementwise, so a
request's image does not depend on its batch-mates.

``family`` is the ``FAMILY`` the registry found for the folder (``registry.family_of_folder``)
and ``pipeline`` what its ``build`` returned; this module reads them through that interface.
"""

from __future__ import annotations

import io
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from PIL import Image

from omnistage.models.diffusion.family import NoiseQuery
from omnistage.stage.diffusion.batch_invariance import batch_invariant_kernels
from omnistage.stage.diffusion.params import (
    SCHEDULER_NAMES,
    DiffusionParams,
    DiffusionRequest,
    ImageOutput,
)
from omnistage.stage.diffusion.video import VideoOutput, quantise, to_mp4

BatchKey = tuple[Hashable, str, float | None]


def scheduler_class_name(pipeline: Any, params: DiffusionParams) -> str:
    """The request's scheduler override, else the pipeline folder's own scheduler."""
    return SCHEDULER_NAMES.get(params.scheduler or "", pipeline.scheduler_class_name)


def batch_key(family: Any, pipeline: Any, request: DiffusionRequest) -> BatchKey:
    """Requests with equal keys can be denoised together (one family key, one scheduler
    class, one flow shift: their timesteps are the same)."""
    params = request.params
    return (
        family.batch_key(pipeline, request),
        scheduler_class_name(pipeline, params),
        params.flow_shift,
    )


def make_scheduler(pipeline: Any, class_name: str, flow_shift: float | None = None) -> Any:
    """A fresh scheduler per request: diffusers schedulers keep per-run state (step index);
    with ``flow_shift``, the folder's scheduler with that shift (as diffusers' users set it:
    ``from_config(scheduler.config, flow_shift=...)``)."""
    overrides = {} if flow_shift is None else {"flow_shift": flow_shift}
    return getattr(diffusers, class_name).from_config(pipeline.scheduler_config, **overrides)


def to_png(pixels: torch.Tensor) -> bytes:
    """PNG of a [H, W, 3] float image in [0, 1], quantised as diffusers' ``numpy_to_pil``."""
    quantised = (pixels * 255).round().to(torch.uint8).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(quantised, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class _Item:
    """One request's state inside a job."""

    request: DiffusionRequest
    seed: int
    conditioning: Any  # the family's, from its ``encode``
    scheduler: Any
    latents: torch.Tensor  # batch dimension 1


class DenoiseJob:
    """Compatible requests (one ``batch_key``) denoised together, one step per ``advance``."""

    @torch.inference_mode()
    def __init__(
        self, family: Any, pipeline: Any, requests: list[DiffusionRequest], seeds: list[int]
    ) -> None:
        self.family, self.pipeline = family, pipeline
        self.key = batch_key(family, pipeline, requests[0])
        _, scheduler_name, flow_shift = self.key
        limits = family.limits(pipeline)
        params = requests[0].params
        self.height = params.height or limits.native_size
        self.width = params.width or limits.native_width or limits.native_size
        self.default_fps = limits.default_fps
        self.items: list[_Item] = []
        for request, seed in zip(requests, seeds, strict=True):
            scheduler = make_scheduler(pipeline, scheduler_name, flow_shift)
            family.set_timesteps(pipeline, scheduler, request)
            latents = family.prepare_latents(pipeline, request, seed, scheduler)
            conditioning = family.encode(pipeline, request)
            self.items.append(_Item(request, seed, conditioning, scheduler, latents))
        self.timesteps = self.items[0].scheduler.timesteps
        self.step_index = 0

    @property
    def request_ids(self) -> list[str]:
        return [item.request.request_id for item in self.items]

    @property
    def is_done(self) -> bool:
        return self.step_index >= len(self.timesteps)

    def drop(self, request_id: str) -> DiffusionRequest | None:
        """Take a request out of the job (abort); the others carry on unchanged."""
        for item in self.items:
            if item.request.request_id == request_id:
                self.items.remove(item)
                return item.request
        return None

    @torch.inference_mode()
    def advance(self) -> None:
        """One denoising step for every request of the job."""
        t = self.timesteps[self.step_index]
        latents = torch.cat(
            [
                item.scheduler.scale_model_input(item.latents, t)
                if hasattr(item.scheduler, "scale_model_input")
                else item.latents
                for item in self.items
            ]
        )
        with batch_invariant_kernels(self.pipeline.device):
            noise_pred = self.family.predict_noise(
                self.pipeline,
                NoiseQuery(
                    latents,
                    t,
                    [item.conditioning for item in self.items],
                    [item.request.params.guidance_scale for item in self.items],
                ),
            )
        for i, item in enumerate(self.items):
            item.latents = item.scheduler.step(
                noise_pred[i : i + 1], t, item.latents, return_dict=False
            )[0]
        self.step_index += 1

    @torch.inference_mode()
    def finish(self) -> list[tuple[DiffusionRequest, ImageOutput | VideoOutput]]:
        """Decode every request's image or video, one at a time (VAE kernels round
        differently per batch size, see ``batch_invariance``)."""
        return [(item.request, self._output(item)) for item in self.items]

    def _output(self, item: _Item) -> ImageOutput | VideoOutput:
        params = item.request.params
        pixels = self.family.decode(self.pipeline, item.latents)
        if params.video:
            frames = pixels if pixels.ndim == 4 else pixels[None]
            fps = params.fps or self.default_fps
            return VideoOutput(
                mp4=to_mp4(quantise(frames), fps),
                width=self.width,
                height=self.height,
                num_frames=int(frames.shape[0]),
                fps=fps,
                seed=item.seed,
                pixels=frames.clone() if params.return_pixels else None,
            )
        if pixels.ndim == 4:  # one frame of a video family
            pixels = pixels[0]
        return ImageOutput(
            png=to_png(pixels),
            width=self.width,
            height=self.height,
            seed=item.seed,
            pixels=pixels.clone() if params.return_pixels else None,
        )
