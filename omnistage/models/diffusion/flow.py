"""What the flow-matching families share, written as diffusers' pipelines compute it: the
dynamic shift ``mu`` from the image's token count, the timesteps a pipeline sets, the 2x2
latent packing of FLUX and Qwen-Image, the VAE's scale factor, text tokenised to a fixed
length, the pieces of their ``build``, ``limits``, ``encode``, latent draw and guidance, and the
pixels of a decoded image."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from omnistage.errors import CheckpointError
from omnistage.models.diffusion.family import (
    DiffusionLimits,
    DiffusionParamsLike,
    DiffusionRequestLike,
)
from omnistage.models.diffusion.pipeline import LoadedPipeline

FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
T = TypeVar("T")


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """diffusers' ``calculate_shift``: ``mu`` linear in the number of image tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def shift_of(config: dict[str, Any], image_seq_len: int) -> float:
    """``mu`` for a scheduler config (its base/max sequence lengths and shifts)."""
    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def set_flow_timesteps(
    scheduler: Any, num_inference_steps: int, device: torch.device, mu: float | None
) -> None:
    """FLUX's and Qwen-Image's timesteps: sigmas ``linspace(1, 1/n, n)`` (unless the
    scheduler makes its own flow sigmas), shifted by ``mu`` when the scheduler shifts
    dynamically; the step index starts at 0 (``set_begin_index``)."""
    sigmas: Any = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    kwargs = {"mu": mu} if scheduler.config.get("use_dynamic_shifting") else {}
    if sigmas is None:
        scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device=device, **kwargs)
    scheduler.set_begin_index(0)


def vae_scale_factor(pipeline: LoadedPipeline) -> int:
    """An ``AutoencoderKL``'s spatial compression: 2 per down block after the first."""
    return int(2 ** (len(pipeline.module("vae").config.block_out_channels) - 1))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` to ``[B, (H/2)(W/2), 4C]``: 2x2 patches as tokens (FLUX, Qwen-Image)."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` for a latent grid of ``latent_height x latent_width``."""
    b, _, channels = latents.shape
    latents = latents.view(b, latent_height // 2, latent_width // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, latent_height, latent_width)


def image_ids(latent_height: int, latent_width: int, device: torch.device) -> torch.Tensor:
    """FLUX's positions of the packed image tokens: ``[(h/2)(w/2), 3]`` (0, row, column)."""
    ids = torch.zeros(latent_height // 2, latent_width // 2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(latent_height // 2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(latent_width // 2)[None, :]
    return ids.reshape(-1, 3).to(device)


def tokenize(tokenizer: Any, text: str, max_length: int, device: torch.device) -> Any:
    """One text padded and truncated to ``max_length`` (what every family's encoder takes)."""
    return tokenizer(
        [text],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        return_tensors="pt",
    ).to(device)


def required_tokenizer(pipeline: LoadedPipeline, name: str) -> Any:
    tokenizer = pipeline.tokenizers.get(name)
    if tokenizer is None:
        raise CheckpointError(f"{pipeline.folder} has no {name}")
    return tokenizer


def to_pixels(image: torch.Tensor) -> torch.Tensor:
    """A decoded image ``[1, 3, H, W]`` in [-1, 1] to float pixels ``[H, W, 3]`` in [0, 1]
    (diffusers' ``VaeImageProcessor.postprocess``)."""
    return (image[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0).float().cpu()


def packed_latent_size(factor: int, height: int, width: int) -> tuple[int, int]:
    """The latent grid diffusers draws: a multiple of 2 per side for the 2x2 packing."""
    return 2 * (height // (factor * 2)), 2 * (width // (factor * 2))


def draw_latents(
    pipeline: LoadedPipeline, shape: tuple[int, ...], seed: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Latents drawn by a CPU generator seeded with ``seed`` (in the pipeline's dtype unless
    ``dtype``), on the pipeline's device."""
    generator = torch.Generator("cpu").manual_seed(seed)
    draw = torch.randn(shape, generator=generator, dtype=dtype or pipeline.dtype)
    return draw.to(pipeline.device)


def image_size(
    pipeline: LoadedPipeline, params: DiffusionParamsLike, sample_size: int | None = None
) -> tuple[int, int]:
    """A request's (height, width); where it gives none, diffusers' default: ``sample_size``
    latent pixels (the transformer's ``sample_size`` unless given) times the VAE's factor."""
    if sample_size is None:
        sample_size = int(pipeline.module("transformer").config.sample_size)
    native = sample_size * vae_scale_factor(pipeline)
    return params.height or native, params.width or native


def draw_image_latents(
    pipeline: LoadedPipeline, params: DiffusionParamsLike, seed: int
) -> torch.Tensor:
    """diffusers' draw for a transformer on unpacked latents: ``[1, C, H / f, W / f]``, its
    ``in_channels`` at the request's ``image_size`` over the VAE's factor ``f``."""
    height, width = image_size(pipeline, params)
    factor = vae_scale_factor(pipeline)
    channels = int(pipeline.module("transformer").config.in_channels)
    return draw_latents(pipeline, (1, channels, height // factor, width // factor), seed)


def text_limits(pipeline: LoadedPipeline, **fields: Any) -> DiffusionLimits:
    """The limits of a family that takes text prompts only and needs its own scheduler."""
    return DiffusionLimits(
        has_text_encoder=True,
        max_inference_steps=int(pipeline.scheduler_config.get("num_train_timesteps", 1000)),
        takes_prompt_embeds=False,
        takes_scheduler_override=False,
        **fields,
    )


@dataclass
class Guided(Generic[T]):
    """A request's conditioning: its conditional input and, when guidance runs, its
    unconditional one (the negative prompt's, or what the family puts in its place)."""

    cond: T
    uncond: T | None


def encode_prompts(
    request: DiffusionRequestLike, encode: Callable[[str, DiffusionParamsLike], T]
) -> Guided[T]:
    """The prompt's conditioning and, when guidance runs, the negative prompt's (diffusers'
    ``encode_prompt``): ``encode`` is the family's text encoder for one text, under the
    request's params (its ``max_sequence_length``)."""
    params = request.params
    cond = encode(request.prompt or "", params)
    uncond = encode(params.negative_prompt, params) if params.uses_guidance else None
    return Guided(cond, uncond)


def unconditional_rows(rows: Sequence[Guided[T]]) -> list[T]:
    """The rows' unconditional inputs (``uncond``): all of them or none."""
    unconds = [row.uncond for row in rows if row.uncond is not None]
    if unconds and len(unconds) != len(rows):
        raise ValueError("the rows of one batch must agree on guidance (see batch_key)")
    return unconds


def guide(uncond: torch.Tensor, cond: torch.Tensor, scales: Sequence[float]) -> torch.Tensor:
    """Classifier-free guidance, each row with its own scale: ``uncond + scale * (cond -
    uncond)``, the scales a tensor of the prediction's dtype broadcast over a row."""
    tensor = torch.tensor(scales, dtype=cond.dtype, device=cond.device)
    return uncond + tensor.view(-1, *[1] * (cond.ndim - 1)) * (cond - uncond)


def decode_shifted(pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
    """An ``AutoencoderKL`` with a shift factor (FLUX, SD3): latents to pixels."""
    vae = pipeline.module("vae")
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    return to_pixels(vae.decode(latents.to(vae.dtype), return_dict=False)[0])
