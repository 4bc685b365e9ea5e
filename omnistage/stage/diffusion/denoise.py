"""The denoising loop for one batch of compatible requests, written to match diffusers' PixArt.

Per request: conditioning (text or given embeddings), a CPU ``torch.Generator`` seeded with the
request's seed drawing its own ``[1, C, h, w]`` latents (what diffusers' ``randn_tensor`` does
with a list of generators), and its own guidance scale. The batch shares the image size, step
count, scheduler and whether guidance runs, so one scheduler instance steps all of it; the
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
    """A fresh scheduler per batch: diffusers schedulers keep per-run state (step index)."""
    return getattr(diffusers, class_name).from_config(pipeline.scheduler_config)


def to_png(pixels: torch.Tensor) -> bytes:
    """PNG of a [H, W, 3] float image in [0, 1], quantised as diffusers' ``numpy_to_pil``."""
    quantised = (pixels * 255).round().to(torch.uint8).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(quantised, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


@torch.inference_mode()
def denoise_batch(
    pipeline: ImagePipeline,
    requests: list[DiffusionRequest],
    seeds: list[int],
    conds: list[tuple[Conditioning, Conditioning | None]],
) -> list[ImageOutput]:
    """Generate one image per request; all requests must share one ``batch_key``."""
    height, width, num_steps, scheduler_name, guided = batch_key(pipeline, requests[0])
    device, dtype = pipeline.device, pipeline.dtype
    scheduler = make_scheduler(pipeline, scheduler_name)
    scheduler.set_timesteps(num_steps, device=device)

    channels = int(pipeline.transformer.config.in_channels)
    factor = pipeline.vae_scale_factor
    shape = (1, channels, height // factor, width // factor)
    latents = torch.cat(
        [
            torch.randn(shape, generator=torch.Generator("cpu").manual_seed(s), dtype=dtype)
            for s in seeds
        ]
    ).to(device)
    latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)

    rows = [c for c, _ in conds]
    if guided:  # diffusers' order: every unconditional row first, then the conditional ones
        rows = [u for _, u in conds if u is not None] + rows
    embeds, mask = _stack(rows)
    scales = torch.tensor([r.params.guidance_scale for r in requests], dtype=dtype, device=device)
    scales = scales.view(-1, 1, 1, 1)
    # A null out_channels means "same as in_channels" (what diffusers saves by default).
    out_channels = pipeline.transformer.config.out_channels or channels
    learned_sigma = int(out_channels) // 2 == channels
    added_cond_kwargs = micro_conditions(pipeline, height, width, embeds.shape[0])

    for t in scheduler.timesteps:
        model_input = torch.cat([latents] * 2) if guided else latents
        if hasattr(scheduler, "scale_model_input"):
            model_input = scheduler.scale_model_input(model_input, t)
        timestep = t[None].to(device).expand(model_input.shape[0])
        with batch_invariant_kernels(device):
            noise_pred = pipeline.transformer(
                model_input,
                encoder_hidden_states=embeds,
                encoder_attention_mask=mask,
                timestep=timestep,
                added_cond_kwargs=added_cond_kwargs,
                return_dict=False,
            )[0]
        if guided:
            uncond, text = noise_pred.chunk(2)
            noise_pred = uncond + scales * (text - uncond)
        if learned_sigma:
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]

    vae = pipeline.vae
    latents = latents.to(vae.dtype) / vae.config.scaling_factor
    # One image at a time: VAE kernels round differently per batch size (see batch_invariance).
    images = torch.cat(
        [vae.decode(latents[i : i + 1], return_dict=False)[0] for i in range(len(requests))]
    )
    pixels = (images * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
    return [
        ImageOutput(
            png=to_png(pixels[i]),
            width=width,
            height=height,
            seed=seeds[i],
            pixels=pixels[i].clone() if request.params.return_pixels else None,
        )
        for i, request in enumerate(requests)
    ]
