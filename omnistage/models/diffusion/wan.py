"""The Wan 2.1 text-to-video family (``WanPipeline``), written to match diffusers' own pipeline.

Components: ``text_encoder`` (UMT5: its last hidden states, the prompt's tokens kept and the
padding up to ``max_sequence_length`` zeroed), ``transformer`` (``WanTransformer3DModel``,
patches over time and space), ``vae`` (``AutoencoderKLWan``, causal in time: 4x temporal and
8x spatial compression, latents de-normalised by its per-channel mean and std) and the
folder's scheduler: the released Wan 2.1 folders ship ``UniPCMultistepScheduler`` predicting
flow with a fixed ``flow_shift``, diffusers' default is ``FlowMatchEulerDiscreteScheduler``;
both are served, each request with its own instance (a multistep solver keeps its history).

Latents are drawn in float32 whatever the transformer's dtype (as diffusers draws them) and
go in as ``[B, C, 1 + (frames - 1) / 4, h / 8, w / 8]``; a video's frame count is 1 + a
multiple of the VAE's temporal factor (1 frame: an image). Classifier-free guidance runs
above 1 with the negative prompt ("" by default), every row of a batch with its own scale.
Prompts are padded to ``max_sequence_length``, so any requests of one size, frame count,
step count and text length batch. Wan 2.2's two-transformer folders (``transformer_2``,
``boundary_ratio``) and its ``expand_timesteps`` image-to-video layout are not served.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from omnistage.errors import CheckpointError
from omnistage.models.diffusion import flow
from omnistage.models.diffusion.components import MODEL_INDEX
from omnistage.models.diffusion.family import (
    DiffusionLimits,
    DiffusionParamsLike,
    DiffusionRequestLike,
    FamilyBase,
    NoiseQuery,
)
from omnistage.models.diffusion.pipeline import LoadedPipeline

SCHEDULERS = ("UniPCMultistepScheduler", flow.FLOW_SCHEDULER)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default (UMT5's training length)
DEFAULT_HEIGHT, DEFAULT_WIDTH = 480, 832  # WanPipeline.__call__'s defaults
DEFAULT_FRAMES = 81  # WanPipeline's default and Wan 2.1's training length
DEFAULT_FPS = 16  # the rate Wan 2.1 is trained at (diffusers' examples export at it)
DEFAULT_GUIDANCE = 5.0


def _scale_factors(pipeline: LoadedPipeline) -> tuple[int, int]:
    """The VAE's (temporal, spatial) compression, as ``WanPipeline`` reads them."""
    config = pipeline.module("vae").config
    return int(config.scale_factor_temporal), int(config.scale_factor_spatial)


def _size_multiple(pipeline: LoadedPipeline) -> int:
    """Height and width are multiples of the VAE factor times the transformer's patch."""
    patch = pipeline.module("transformer").config.patch_size
    return _scale_factors(pipeline)[1] * max(int(patch[1]), int(patch[2]))


def _video_size(params: DiffusionParamsLike) -> tuple[int, int, int]:
    """(frames, height, width): a request without frames is one frame (the stage fills in
    the default of a video request)."""
    return params.num_frames or 1, params.height or DEFAULT_HEIGHT, params.width or DEFAULT_WIDTH


def _max_sequence_length(params: DiffusionParamsLike) -> int:
    return params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def _encode_text(pipeline: LoadedPipeline, text: str, params: DiffusionParamsLike) -> torch.Tensor:
    """``WanPipeline._get_t5_prompt_embeds`` for one text: cleaned as diffusers cleans it,
    padded to the request's ``max_sequence_length``, the states past the prompt's tokens
    zeroed."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    length = _max_sequence_length(params)
    tokenizer = flow.required_tokenizer(pipeline, "tokenizer")
    tokens = tokenizer(
        [prompt_clean(text)],
        padding="max_length",
        max_length=length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    ).to(pipeline.device)
    num_tokens = int(tokens.attention_mask.gt(0).sum())
    states = pipeline.module("text_encoder")(
        tokens.input_ids, tokens.attention_mask
    ).last_hidden_state[0]
    states = states.to(pipeline.dtype)
    return torch.cat([states[:num_tokens], states.new_zeros(length - num_tokens, states.shape[1])])


def _model_index(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / MODEL_INDEX).read_text()))


class WanFamily(FamilyBase):
    name = "wan"
    required = ("transformer", "vae", "text_encoder")
    label = "Wan"
    schedulers = SCHEDULERS
    template = "video.yaml"

    def check(self, pipeline: LoadedPipeline) -> None:
        """Wan 2.2's layouts and image-to-video transformers."""
        index = _model_index(pipeline.folder)
        if pipeline.optional_module("transformer_2") is not None or index.get("boundary_ratio"):
            raise CheckpointError(
                f"{pipeline.folder}: Wan 2.2's two-transformer denoising "
                "(transformer_2, boundary_ratio) is not served"
            )
        if index.get("expand_timesteps"):
            raise CheckpointError(
                f"{pipeline.folder}: Wan 2.2's per-token timesteps (expand_timesteps) are not served"
            )
        if pipeline.module("transformer").config.image_dim is not None:
            raise CheckpointError(
                f"{pipeline.folder}/transformer: image-to-video transformers (image_dim) are "
                "not served by the text-to-video family"
            )

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits:
        config = pipeline.module("transformer").config
        temporal, spatial = _scale_factors(pipeline)
        # Its rotary table covers rope_max_seq_len positions on each axis (diffusers' rope
        # slices it per axis and cannot view past its end): a longer side, or more latent
        # frames, is a 400 naming the field, not the model's error as a 500.
        reach = int(getattr(config, "rope_max_seq_len", 0) or 0)
        patch = config.patch_size
        max_frames = DEFAULT_FRAMES
        if reach:
            max_frames = min(max_frames, (reach * int(patch[0]) - 1) * temporal + 1)
        return flow.text_limits(
            pipeline,
            size_multiple=_size_multiple(pipeline),
            embedding_dim=int(config.text_dim),
            native_size=DEFAULT_HEIGHT,
            native_width=DEFAULT_WIDTH,
            max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH,
            max_frames=max_frames,
            max_side=reach * spatial * min(int(patch[1]), int(patch[2])) if reach else None,
            frame_step=temporal,
            default_frames=DEFAULT_FRAMES,
            default_fps=DEFAULT_FPS,
            default_guidance_scale=DEFAULT_GUIDANCE,
        )

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        params = request.params
        return (
            _video_size(params),
            params.num_inference_steps,
            _max_sequence_length(params),
            params.uses_guidance,
        )

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        return flow.encode_prompts(request, functools.partial(_encode_text, pipeline))

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        """The scheduler's own timesteps (Wan's shift is fixed in its config), the step index
        from 0 as ``WanPipeline`` sets it."""
        scheduler.set_timesteps(request.params.num_inference_steps, device=pipeline.device)
        scheduler.set_begin_index(0)

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        frames, height, width = _video_size(request.params)
        temporal, spatial = _scale_factors(pipeline)
        channels = int(pipeline.module("transformer").config.in_channels)
        shape = (1, channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)
        return flow.draw_latents(pipeline, shape, seed, dtype=torch.float32)

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        """One transformer call for the batch: every request's conditional row, then (when
        guidance runs) every unconditional one; each row combined with its own scale as
        ``WanPipeline`` combines it (a Python float times the difference)."""
        rows: list[flow.Guided[torch.Tensor]] = list(query.conditioning)
        unconds = flow.unconditional_rows(rows)
        model_input = query.latents.to(pipeline.dtype)
        if unconds:
            model_input = torch.cat([model_input, model_input])
        states = torch.stack([row.cond for row in rows] + unconds)
        noise = pipeline.module("transformer")(
            hidden_states=model_input,
            timestep=query.timestep.to(pipeline.device).expand(model_input.shape[0]),
            encoder_hidden_states=states,
            return_dict=False,
        )[0]
        if not unconds:
            return noise
        cond, uncond = noise.chunk(2)
        return torch.cat(
            [
                uncond[i : i + 1] + float(scale) * (cond[i : i + 1] - uncond[i : i + 1])
                for i, scale in enumerate(query.guidance_scales)
            ]
        )

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        """One request's latents to frames ``[F, H, W, 3]`` in [0, 1]
        (``VideoProcessor.postprocess_video``)."""
        vae = pipeline.module("vae")
        z_dim = int(vae.config.z_dim)
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents)
        video = vae.decode(latents / std + mean, return_dict=False)[0]
        return (video[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).float().cpu()


FAMILY = WanFamily()
