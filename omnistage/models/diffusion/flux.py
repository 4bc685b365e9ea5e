"""The FLUX.1 family (``FluxPipeline``), written to match diffusers' own pipeline.

Components: ``text_encoder`` (CLIP: its pooled output), ``text_encoder_2`` (T5: the token
states), their tokenizers, ``transformer`` (``FluxTransformer2DModel``), ``vae``
(``AutoencoderKL`` with a shift factor) and a flow-matching scheduler with dynamic shift.
Latents are 2x2-packed into tokens; the timestep goes in as ``t / 1000``; FLUX.1-dev's
guidance is an embedding (``guidance_embeds``), one scale per row of a batch, so requests of
any guidance share a loop. FLUX's true classifier-free guidance (``true_cfg_scale`` with a
negative prompt) is not served: a negative prompt is refused by the stage (``limits``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.models.diffusion import flow
from omnistage.models.diffusion.family import (
    DiffusionLimits,
    DiffusionParamsLike,
    DiffusionRequestLike,
    FamilyBase,
    NoiseQuery,
)
from omnistage.models.diffusion.pipeline import LoadedPipeline

MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default and its ceiling
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline's default_sample_size (latent pixels)
DEFAULT_GUIDANCE = 3.5


@dataclass
class FluxConditioning:
    """T5 token states ``[seq, dim]`` and CLIP's pooled output ``[pooled_dim]``."""

    embeds: torch.Tensor
    pooled: torch.Tensor


def _image_size(pipeline: LoadedPipeline, params: DiffusionParamsLike) -> tuple[int, int]:
    return flow.image_size(pipeline, params, DEFAULT_SAMPLE_SIZE)


def _latent_size(pipeline: LoadedPipeline, height: int, width: int) -> tuple[int, int]:
    return flow.packed_latent_size(flow.vae_scale_factor(pipeline), height, width)


def _sequence_limit(pipeline: LoadedPipeline) -> int:
    """The most T5 tokens: FluxPipeline's ceiling, within the tokenizer's length."""
    limit = getattr(pipeline.tokenizers.get("tokenizer_2"), "model_max_length", None)
    return min(MAX_SEQUENCE_LENGTH, limit) if isinstance(limit, int) else MAX_SEQUENCE_LENGTH


def _max_sequence_length(pipeline: LoadedPipeline, params: DiffusionParamsLike) -> int:
    if params.max_sequence_length is not None:
        return params.max_sequence_length
    return _sequence_limit(pipeline)


class FluxFamily(FamilyBase):
    name = "flux"
    required = ("transformer", "vae", "text_encoder", "text_encoder_2")
    label = "FLUX"
    schedulers = (flow.FLOW_SCHEDULER,)

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits:
        config = pipeline.module("transformer").config
        factor = flow.vae_scale_factor(pipeline)
        return flow.text_limits(
            pipeline,
            size_multiple=factor * 2,
            embedding_dim=int(config.joint_attention_dim),
            native_size=DEFAULT_SAMPLE_SIZE * factor,
            takes_negative_prompt=False,
            max_sequence_length=_sequence_limit(pipeline),
            default_guidance_scale=DEFAULT_GUIDANCE,
        )

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        params = request.params
        height, width = _image_size(pipeline, params)
        return height, width, params.num_inference_steps, _max_sequence_length(pipeline, params)

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        """CLIP's pooled output (padded to the tokenizer's length) and T5's states (padded to
        ``max_sequence_length``), as ``FluxPipeline.encode_prompt``."""
        text = request.prompt or ""
        device = pipeline.device
        clip_tokenizer = flow.required_tokenizer(pipeline, "tokenizer")
        clip_ids = flow.tokenize(clip_tokenizer, text, clip_tokenizer.model_max_length, device)
        clip = pipeline.module("text_encoder")
        pooled = clip(clip_ids.input_ids, output_hidden_states=False).pooler_output
        t5_tokenizer = flow.required_tokenizer(pipeline, "tokenizer_2")
        length = _max_sequence_length(pipeline, request.params)
        t5_ids = flow.tokenize(t5_tokenizer, text, length, device)
        embeds = pipeline.module("text_encoder_2")(t5_ids.input_ids, output_hidden_states=False)[0]
        return FluxConditioning(embeds[0].to(pipeline.dtype), pooled[0].to(pipeline.dtype))

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        height, width = _image_size(pipeline, request.params)
        latent_height, latent_width = _latent_size(pipeline, height, width)
        image_seq_len = (latent_height // 2) * (latent_width // 2)
        mu = flow.shift_of(pipeline.scheduler_config, image_seq_len)
        flow.set_flow_timesteps(scheduler, request.params.num_inference_steps, pipeline.device, mu)

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        """diffusers' draw ``[1, C, h, w]``, kept unpacked: the scheduler's update is
        elementwise, so packing only around the transformer gives the same numbers."""
        height, width = _image_size(pipeline, request.params)
        latent_height, latent_width = _latent_size(pipeline, height, width)
        channels = int(pipeline.module("transformer").config.in_channels) // 4
        return flow.draw_latents(pipeline, (1, channels, latent_height, latent_width), seed)

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        transformer = pipeline.module("transformer")
        rows: list[FluxConditioning] = list(query.conditioning)
        device, num_rows = pipeline.device, query.latents.shape[0]
        latent_height, latent_width = query.latents.shape[-2:]
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.tensor(query.guidance_scales, dtype=torch.float32, device=device)
        embeds = torch.stack([row.embeds for row in rows])
        packed = flow.pack_latents(query.latents)
        noise = transformer(
            hidden_states=packed,
            timestep=query.timestep.to(device).expand(num_rows).to(packed.dtype) / 1000,
            guidance=guidance,
            pooled_projections=torch.stack([row.pooled for row in rows]),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=pipeline.dtype),
            img_ids=flow.image_ids(latent_height, latent_width, device).to(pipeline.dtype),
            return_dict=False,
        )[0]
        return flow.unpack_latents(noise, latent_height, latent_width)

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        return flow.decode_shifted(pipeline, latents)


FAMILY = FluxFamily()
