"""The PixArt family (``PixArtAlphaPipeline``, ``PixArtSigmaPipeline``, and our tiny presets,
which use the Sigma layout), written to match diffusers' own pipelines.

Components: ``transformer`` (a ``PixArtTransformer2DModel``-like denoiser taking
``encoder_hidden_states`` + ``encoder_attention_mask``), ``vae`` (``AutoencoderKL``),
``scheduler``, and optionally ``text_encoder`` (T5) + ``tokenizer``. Text is encoded as
diffusers' PixArt does it: lower-cased and stripped, padded to ``max_length``, its attention
mask kept. PixArt-alpha transformers with ``use_additional_conditions`` take resolution and
aspect-ratio micro-conditions; learned-sigma transformers return twice the latent channels,
of which the first half is the noise.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import CheckpointError
from omnistage.models.diffusion import flow
from omnistage.models.diffusion.family import (
    DiffusionLimits,
    DiffusionRequestLike,
    FamilyBase,
    NoiseQuery,
)
from omnistage.models.diffusion.pipeline import LoadedPipeline

# diffusers' own max_sequence_length defaults per pipeline class (PixArt-alpha: 120).
_MAX_SEQUENCE_LENGTH = {"PixArtAlphaPipeline": 120}
_DEFAULT_MAX_SEQUENCE_LENGTH = 300


@dataclass
class TextEmbeds:
    """Encoder states and their attention mask (1 = attend) for one request."""

    embeds: torch.Tensor  # [seq, dim]
    mask: torch.Tensor  # [seq]


def _default_max_sequence_length(pipeline: LoadedPipeline) -> int:
    default = _MAX_SEQUENCE_LENGTH.get(pipeline.class_name, _DEFAULT_MAX_SEQUENCE_LENGTH)
    limit = getattr(pipeline.tokenizer, "model_max_length", None)
    return min(default, int(limit)) if isinstance(limit, int) and limit > 0 else default


def _encode_text(pipeline: LoadedPipeline, text: str, max_length: int) -> TextEmbeds:
    """``embeddings [max_length, dim]`` and ``mask [max_length]`` as diffusers' PixArt does
    it: lower-case and strip the text (its ``clean_caption=False`` preprocessing), pad to
    ``max_length``, truncate, add special tokens, keep the padded positions."""
    text_encoder = pipeline.optional_module("text_encoder")
    if pipeline.tokenizer is None or text_encoder is None:
        raise CheckpointError(f"{pipeline.folder} has no text encoder")
    tokens = pipeline.tokenizer(
        [text.lower().strip()],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask.to(pipeline.device)
    hidden = text_encoder(tokens.input_ids.to(pipeline.device), attention_mask=mask)[0]
    return TextEmbeds(hidden[0].to(pipeline.dtype), mask[0])


def _given(pipeline: LoadedPipeline, embeds: torch.Tensor) -> TextEmbeds:
    """Given embeddings, every position attended."""
    device = pipeline.device
    embeds = embeds.to(device=device, dtype=pipeline.dtype)
    return TextEmbeds(embeds, torch.ones(embeds.shape[0], dtype=torch.long, device=device))


def _stack(rows: list[TextEmbeds]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence; padded positions are masked out of cross-attention."""
    length = max(row.embeds.shape[0] for row in rows)
    embeds = torch.stack(
        [torch.nn.functional.pad(r.embeds, (0, 0, 0, length - r.embeds.shape[0])) for r in rows]
    )
    mask = torch.stack(
        [torch.nn.functional.pad(r.mask, (0, length - r.mask.shape[0])) for r in rows]
    )
    return embeds, mask


def _micro_conditions(
    pipeline: LoadedPipeline, height: int, width: int, num_rows: int
) -> dict[str, torch.Tensor | None]:
    """PixArt-alpha's resolution and aspect-ratio inputs, for transformers that take them
    (``use_additional_conditions``, the default for ``sample_size`` 128), as its pipeline
    builds them; ``None`` for the others, as PixArt-Sigma passes."""
    if not getattr(pipeline.module("transformer"), "use_additional_conditions", False):
        return {"resolution": None, "aspect_ratio": None}
    device, dtype = pipeline.device, pipeline.dtype
    resolution = torch.tensor([height, width]).repeat(num_rows, 1)
    aspect_ratio = torch.tensor([float(height / width)]).repeat(num_rows, 1)
    return {
        "resolution": resolution.to(dtype=dtype, device=device),
        "aspect_ratio": aspect_ratio.to(dtype=dtype, device=device),
    }


class PixArtFamily(FamilyBase):
    name = "pixart"
    component_tags = False

    def check(self, pipeline: LoadedPipeline) -> None:
        if pipeline.scheduler_config.get("use_dynamic_shifting"):
            # A dynamic shift needs a resolution-dependent 'mu' that PixArt's pipelines never
            # compute; serving it anyway would give images diffusers cannot reproduce.
            raise CheckpointError(
                f"{pipeline.folder}/scheduler: use_dynamic_shifting schedulers need a "
                "resolution dependent 'mu', which the PixArt family does not compute"
            )

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits:
        config = pipeline.module("transformer").config
        factor = flow.vae_scale_factor(pipeline)
        return DiffusionLimits(
            size_multiple=factor * int(config.patch_size),
            embedding_dim=int(config.caption_channels),
            has_text_encoder=pipeline.optional_module("text_encoder") is not None,
            native_size=int(config.sample_size) * factor,
            max_inference_steps=int(pipeline.scheduler_config.get("num_train_timesteps", 1000)),
        )

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        params = request.params
        height, width = flow.image_size(pipeline, params)
        return height, width, params.num_inference_steps, params.uses_guidance

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        """See ``DiffusionFamily.encode``. The unconditional input is, in order of
        preference: ``negative_prompt_embeds``, the encoded ``negative_prompt`` padded to the
        prompt's length (diffusers' rule), or one all-zero token."""
        params = request.params
        if request.prompt_embeds is not None:
            cond = _given(pipeline, request.prompt_embeds)
        else:
            max_length = params.max_sequence_length or _default_max_sequence_length(pipeline)
            cond = _encode_text(pipeline, request.prompt or "", max_length)
        if not params.uses_guidance:
            return flow.Guided(cond, None)
        if request.negative_prompt_embeds is not None:
            uncond = _given(pipeline, request.negative_prompt_embeds)
        elif pipeline.optional_module("text_encoder") is not None:
            uncond = _encode_text(pipeline, params.negative_prompt, cond.embeds.shape[0])
        else:
            zeros = torch.zeros(1, cond.embeds.shape[1], dtype=pipeline.dtype)
            uncond = _given(pipeline, zeros)
        return flow.Guided(cond, uncond)

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        scheduler.set_timesteps(request.params.num_inference_steps, device=pipeline.device)

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        noise = flow.draw_image_latents(pipeline, request.params, seed)
        return noise * getattr(scheduler, "init_noise_sigma", 1.0)

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        transformer = pipeline.module("transformer")
        rows: list[flow.Guided[TextEmbeds]] = list(query.conditioning)
        unconds = flow.unconditional_rows(rows)
        guided = bool(unconds)
        # diffusers' order: every unconditional row first, then the conditional ones.
        embeds, mask = _stack([*unconds, *(row.cond for row in rows)])
        latents = query.latents
        model_input = torch.cat([latents] * 2) if guided else latents
        factor = flow.vae_scale_factor(pipeline)
        height, width = latents.shape[-2] * factor, latents.shape[-1] * factor
        noise_pred = transformer(
            model_input,
            encoder_hidden_states=embeds,
            encoder_attention_mask=mask,
            timestep=query.timestep[None].to(pipeline.device).expand(model_input.shape[0]),
            added_cond_kwargs=_micro_conditions(pipeline, height, width, embeds.shape[0]),
            return_dict=False,
        )[0]
        if guided:
            uncond, text = noise_pred.chunk(2)
            noise_pred = flow.guide(uncond, text, query.guidance_scales)
        channels = int(transformer.config.in_channels)
        # A null out_channels means "same as in_channels" (what diffusers saves by default).
        out_channels = int(transformer.config.out_channels or channels)
        if out_channels // 2 == channels:  # learned sigma: the second half is the variance
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        return noise_pred

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        vae = pipeline.module("vae")
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (image[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0).float().cpu()


FAMILY = PixArtFamily()
