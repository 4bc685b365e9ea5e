"""The Stable Diffusion 3 / 3.5 family (``StableDiffusion3Pipeline``), written to match
diffusers' own pipeline.

Components: ``text_encoder`` and ``text_encoder_2`` (CLIP with projection: the penultimate
layer's states side by side, the projected outputs joined as the pooled input),
``text_encoder_3`` (T5, optional: zeros stand in, as diffusers does), ``transformer``
(``SD3Transformer2DModel``), ``vae`` (``AutoencoderKL`` with a shift factor) and a
flow-matching scheduler (SD3.5's dynamic shift included). The CLIP states are padded to T5's
width and put before T5's. Classifier-free guidance runs batched: every request's
unconditional row (its negative prompt, "" by default) first, then the conditional ones,
each with its own scale.
"""

from __future__ import annotations

import functools
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

MAX_SEQUENCE_LENGTH = 512  # StableDiffusion3Pipeline's ceiling
DEFAULT_MAX_SEQUENCE_LENGTH = 256  # and its default
DEFAULT_GUIDANCE = 7.0


@dataclass
class TextInput:
    embeds: torch.Tensor  # [clip tokens + t5 tokens, joint_attention_dim]
    pooled: torch.Tensor  # [pooled_projection_dim]


def _max_sequence_length(params: DiffusionParamsLike) -> int:
    return params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def _clip(pipeline: LoadedPipeline, index: str, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A CLIP's penultimate states ``[77, dim]`` and projected output ``[proj]``."""
    tokenizer = flow.required_tokenizer(pipeline, f"tokenizer{index}")
    ids = flow.tokenize(tokenizer, text, tokenizer.model_max_length, pipeline.device).input_ids
    out = pipeline.module(f"text_encoder{index}")(ids, output_hidden_states=True)
    return out.hidden_states[-2][0], out[0][0]


def _t5(pipeline: LoadedPipeline, text: str, length: int) -> torch.Tensor:
    encoder = pipeline.optional_module("text_encoder_3")
    if encoder is None:
        dim = int(pipeline.module("transformer").config.joint_attention_dim)
        return torch.zeros(length, dim, device=pipeline.device, dtype=pipeline.dtype)
    tokenizer = flow.required_tokenizer(pipeline, "tokenizer_3")
    ids = flow.tokenize(tokenizer, text, length, pipeline.device).input_ids
    return encoder(ids)[0][0]


def _encode_text(pipeline: LoadedPipeline, text: str, params: DiffusionParamsLike) -> TextInput:
    """``StableDiffusion3Pipeline.encode_prompt`` for one text (every encoder gets it)."""
    states_1, pooled_1 = _clip(pipeline, "", text)
    states_2, pooled_2 = _clip(pipeline, "_2", text)
    t5 = _t5(pipeline, text, _max_sequence_length(params))
    clip = torch.cat([states_1, states_2], dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    embeds = torch.cat([clip, t5], dim=-2).to(pipeline.dtype)
    return TextInput(embeds, torch.cat([pooled_1, pooled_2], dim=-1).to(pipeline.dtype))


class SD3Family(FamilyBase):
    name = "sd3"
    required = ("transformer", "vae", "text_encoder", "text_encoder_2")
    label = "Stable Diffusion 3"
    schedulers = (flow.FLOW_SCHEDULER,)

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits:
        config = pipeline.module("transformer").config
        factor = flow.vae_scale_factor(pipeline)
        return flow.text_limits(
            pipeline,
            size_multiple=factor * int(config.patch_size),
            embedding_dim=int(config.joint_attention_dim),
            native_size=int(config.sample_size) * factor,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            default_guidance_scale=DEFAULT_GUIDANCE,
            # Its position embedding covers pos_embed_max_size patches a side (diffusers'
            # PatchEmbed refuses more): a larger side is a 400, not the model's error.
            max_side=_max_side(config, factor),
        )

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        params = request.params
        height, width = flow.image_size(pipeline, params)
        steps = params.num_inference_steps
        return height, width, steps, _max_sequence_length(params), params.uses_guidance

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        return flow.encode_prompts(request, functools.partial(_encode_text, pipeline))

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        """The scheduler's own timesteps; SD3.5's dynamic shift takes ``mu`` from the
        number of image patches (with diffusers' SD3 default ``max_shift`` 1.16)."""
        kwargs = {}
        if pipeline.scheduler_config.get("use_dynamic_shifting"):
            height, width = flow.image_size(pipeline, request.params)
            factor = flow.vae_scale_factor(pipeline)
            patch = int(pipeline.module("transformer").config.patch_size)
            seq_len = (height // factor // patch) * (width // factor // patch)
            config = {"max_shift": 1.16, **pipeline.scheduler_config}
            kwargs["mu"] = flow.shift_of(config, seq_len)
        scheduler.set_timesteps(
            request.params.num_inference_steps, device=pipeline.device, **kwargs
        )

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        return flow.draw_image_latents(pipeline, request.params, seed)

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        rows: list[flow.Guided[TextInput]] = list(query.conditioning)
        unconds = flow.unconditional_rows(rows)
        # diffusers' order: every unconditional row first, then the conditional ones.
        inputs = [*unconds, *(row.cond for row in rows)]
        model_input = torch.cat([query.latents] * 2) if unconds else query.latents
        noise = pipeline.module("transformer")(
            hidden_states=model_input,
            timestep=query.timestep.to(pipeline.device).expand(model_input.shape[0]),
            encoder_hidden_states=torch.stack([row.embeds for row in inputs]),
            pooled_projections=torch.stack([row.pooled for row in inputs]),
            return_dict=False,
        )[0]
        if not unconds:
            return noise
        uncond, text = noise.chunk(2)
        return flow.guide(uncond, text, query.guidance_scales)

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        return flow.decode_shifted(pipeline, latents)


FAMILY = SD3Family()


def _max_side(config: Any, factor: int) -> int | None:
    patches = getattr(config, "pos_embed_max_size", None)
    return int(patches) * int(config.patch_size) * factor if patches else None
