"""The denoising loop, one step at a time, written to match diffusers' PixArt.

A ``DenoiseJob`` is a batch of compatible requests (same image size, step count, scheduler,
and whether guidance runs) that ``advance()`` moves one denoising step: one transformer call
for the whole batch, then each request's own scheduler step. The engine interleaves the
steps of several jobs and checks for aborts between them, so a large request never holds the
stage for its whole run, and an aborted request leaves its batch at the next step.

Per request: conditioning (text or given embeddings), a CPU ``torch.Generator`` seeded with
the request's seed drawing its own ``[1, C, h, w]`` latents (what diffusers' ``randn_tensor``
does with a list of generators), its own guidance scale and its own scheduler instance. The
scheduler's update is elementwise, so a request's image does not depend on its batch-mates.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from PIL import Image

from omnistage.stage.diffusion.batch_invariance import batch_invariant_kernels
from omnistage.stage.diffusion.params import SCHEDULER_NAMES, DiffusionRequest, ImageOutput
from omnistage.stage.diffusion.pipeline import ImagePipeline

BatchKey = tuple[int, int, int, str, bool]


@dataclass
class Conditioning:
    """Encoder states and their attention mask (1 = attend) for one request."""

    embeds: torch.Tensor  # [seq, dim]
    mask: torch.Tensor  # [seq]


def image_size(pipeline: ImagePipeline, request: DiffusionRequest) -> tuple[int, int]:
    params = request.params
    return params.height or pipeline.native_size, params.width or pipeline.native_size


def batch_key(pipeline: ImagePipeline, request: DiffusionRequest) -> BatchKey:
    """Requests with equal keys can be denoised together."""
    height, width = image_size(pipeline, request)
    params = request.params
    scheduler = SCHEDULER_NAMES.get(params.scheduler or "", pipeline.scheduler_class_name)
    return height, width, params.num_inference_steps, scheduler, params.uses_guidance


def conditioning(
    pipeline: ImagePipeline, request: DiffusionRequest
) -> tuple[Conditioning, Conditioning | None]:
    """The request's conditional and (when guided) unconditional inputs.

    Text is encoded one request at a time, like diffusers does for a single prompt, so the
    embeddings never depend on batch-mates. The unconditional input is, in order of
    preference: ``negative_prompt_embeds``, the encoded ``negative_prompt`` padded to the
    prompt's length (diffusers' rule), or one all-zero token.
    """
    device, dtype = pipeline.device, pipeline.dtype
    params = request.params
    if request.prompt_embeds is not None:
        embeds = request.prompt_embeds.to(device=device, dtype=dtype)
        cond = Conditioning(embeds, torch.ones(embeds.shape[0], dtype=torch.long, device=device))
    else:
        max_length = params.max_sequence_length or pipeline.default_max_sequence_length
        cond = Conditioning(*pipeline.encode_text(request.prompt or "", max_length))
    if not params.uses_guidance:
        return cond, None
    if request.negative_prompt_embeds is not None:
        neg = request.negative_prompt_embeds.to(device=device, dtype=dtype)
        uncond = Conditioning(neg, torch.ones(neg.shape[0], dtype=torch.long, device=device))
    elif pipeline.text_encoder is not None:
        uncond = Conditioning(*pipeline.encode_text(params.negative_prompt, cond.embeds.shape[0]))
    else:
        zeros = torch.zeros(1, cond.embeds.shape[1], dtype=dtype, device=device)
        uncond = Conditioning(zeros, torch.ones(1, dtype=torch.long, device=device))
    return cond, uncond


def _stack(conds: list[Conditioning]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence; padded positions are masked out of cross-attention."""
    length = max(c.embeds.shape[0] for c in conds)
    embeds = torch.stack(
        [torch.nn.functional.pad(c.embeds, (0, 0, 0, length - c.embeds.shape[0])) for c in conds]
    )
    mask = torch.stack(
        [torch.nn.functional.pad(c.mask, (0, length - c.mask.shape[0])) for c in conds]
    )
    return embeds, mask


def micro_conditions(
    pipeline: ImagePipeline, height: int, width: int, num_rows: int
) -> dict[str, torch.Tensor | None]:
    """PixArt-alpha's resolution and aspect-ratio inputs, for transformers that take them
    (``use_additional_conditions``, the default for ``sample_size`` 128), as its pipeline
    builds them; ``None`` for the others, as PixArt-Sigma passes."""
    if not getattr(pipeline.transformer, "use_additional_conditions", False):
        return {"resolution": None, "aspect_ratio": None}
    device, dtype = pipeline.device, pipeline.dtype
    resolution = torch.tensor([height, width]).repeat(num_rows, 1)
    aspect_ratio = torch.tensor([float(height / width)]).repeat(num_rows, 1)
    return {
        "resolution": resolution.to(dtype=dtype, device=device),
        "aspect_ratio": aspect_ratio.to(dtype=dtype, device=device),
    }


def make_scheduler(pipeline: ImagePipeline, class_name: str) -> Any:
    """A fresh scheduler per request: diffusers schedulers keep per-run state (step index)."""
    return getattr(diffusers, class_name).from_config(pipeline.scheduler_config)


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
    cond: Conditioning
    uncond: Conditioning | None
    scheduler: Any
    latents: torch.Tensor  # [1, C, h, w]


class DenoiseJob:
    """Compatible requests (one ``batch_key``) denoised together, one step per ``advance``."""

    @torch.inference_mode()
    def __init__(
        self, pipeline: ImagePipeline, requests: list[DiffusionRequest], seeds: list[int]
    ) -> None:
        self.pipeline = pipeline
        self.key = batch_key(pipeline, requests[0])
        height, width, num_steps, scheduler_name, self.guided = self.key
        self.height, self.width = height, width
        device, dtype = pipeline.device, pipeline.dtype
        channels = int(pipeline.transformer.config.in_channels)
        factor = pipeline.vae_scale_factor
        shape = (1, channels, height // factor, width // factor)
        self.items: list[_Item] = []
        for request, seed in zip(requests, seeds, strict=True):
            scheduler = make_scheduler(pipeline, scheduler_name)
            scheduler.set_timesteps(num_steps, device=device)
            noise = torch.randn(
                shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=dtype
            )
            latents = noise.to(device) * getattr(scheduler, "init_noise_sigma", 1.0)
            self.items.append(
                _Item(request, seed, *conditioning(pipeline, request), scheduler, latents)
            )
        self.timesteps = self.items[0].scheduler.timesteps
        self.step_index = 0
        # A null out_channels means "same as in_channels" (what diffusers saves by default).
        out_channels = pipeline.transformer.config.out_channels or channels
        self.learned_sigma = int(out_channels) // 2 == channels

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
        pipeline, device = self.pipeline, self.pipeline.device
        t = self.timesteps[self.step_index]
        latents = torch.cat(
            [
                item.scheduler.scale_model_input(item.latents, t)
                if hasattr(item.scheduler, "scale_model_input")
                else item.latents
                for item in self.items
            ]
        )
        rows = [item.cond for item in self.items]
        if self.guided:  # diffusers' order: every unconditional row first, then the conditional
            rows = [item.uncond for item in self.items if item.uncond is not None] + rows
        embeds, mask = _stack(rows)
        model_input = torch.cat([latents] * 2) if self.guided else latents
        timestep = t[None].to(device).expand(model_input.shape[0])
        with batch_invariant_kernels(device):
            noise_pred = pipeline.transformer(
                model_input,
                encoder_hidden_states=embeds,
                encoder_attention_mask=mask,
                timestep=timestep,
                added_cond_kwargs=micro_conditions(
                    pipeline, self.height, self.width, embeds.shape[0]
                ),
                return_dict=False,
            )[0]
        if self.guided:
            uncond, text = noise_pred.chunk(2)
            scales = torch.tensor(
                [item.request.params.guidance_scale for item in self.items],
                dtype=pipeline.dtype,
                device=device,
            ).view(-1, 1, 1, 1)
            noise_pred = uncond + scales * (text - uncond)
        if self.learned_sigma:
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        for i, item in enumerate(self.items):
            item.latents = item.scheduler.step(
                noise_pred[i : i + 1], t, item.latents, return_dict=False
            )[0]
        self.step_index += 1

    @torch.inference_mode()
    def finish(self) -> list[tuple[DiffusionRequest, ImageOutput]]:
        """Decode every request's image, one at a time (VAE kernels round differently per
        batch size, see ``batch_invariance``)."""
        vae = self.pipeline.vae
        results = []
        for item in self.items:
            latents = item.latents.to(vae.dtype) / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
            pixels = (image[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0).float().cpu()
            output = ImageOutput(
                png=to_png(pixels),
                width=self.width,
                height=self.height,
                seed=item.seed,
                pixels=pixels.clone() if item.request.params.return_pixels else None,
            )
            results.append((item.request, output))
        return results


def denoise_batch(
    pipeline: ImagePipeline, requests: list[DiffusionRequest], seeds: list[int]
) -> list[ImageOutput]:
    """Generate one image per request, all steps at once; all must share one ``batch_key``."""
    job = DenoiseJob(pipeline, requests, seeds)
    while not job.is_done:
        job.advance()
    return [image for _, image in job.finish()]
