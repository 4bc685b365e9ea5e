"""The Qwen-Image family (``QwenImagePipeline``), written to match diffusers' own pipeline.

Components: ``text_encoder`` (Qwen2.5-VL: the last hidden states of the prompt inside the
pipeline's chat template, its first 34 tokens dropped), ``transformer``
(``QwenImageTransformer2DModel``), ``vae`` (``AutoencoderKLQwenImage``, a causal 3-D VAE
decoding one frame, latents de-normalised by its per-channel mean and std) and a
flow-matching scheduler with dynamic shift. Latents are 2x2-packed around the transformer.

``guidance_scale`` is the pipeline's ``true_cfg_scale``: above 1 the negative prompt ("" by
default) runs as a second transformer call and the result is rescaled to the conditional
prediction's norm. Prompt embeddings are as long as the prompt (no padding), so requests
batch when their prompts (and negative prompts) have the same number of tokens: padding them
would change the numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch

from omnistage.errors import CheckpointError
from omnistage.models.diffusion import flow
from omnistage.models.diffusion.family import (
    DiffusionLimits,
    DiffusionParamsLike,
    DiffusionRequestLike,
    FamilyBase,
    NoiseQuery,
)
from omnistage.models.diffusion.pipeline import LoadedPipeline

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_START = 34  # template tokens dropped from the encoder's states (diffusers' constant)
TOKENIZER_MAX_LENGTH = 1024
DEFAULT_MAX_SEQUENCE_LENGTH = 512
DEFAULT_SAMPLE_SIZE = 128
DEFAULT_GUIDANCE = 4.0  # QwenImagePipeline's true_cfg_scale


def _vae_scale_factor(pipeline: LoadedPipeline) -> int:
    return int(2 ** len(pipeline.module("vae").config.temperal_downsample))


def _image_size(pipeline: LoadedPipeline, params: DiffusionParamsLike) -> tuple[int, int]:
    native = DEFAULT_SAMPLE_SIZE * _vae_scale_factor(pipeline)
    return params.height or native, params.width or native


def _latent_size(pipeline: LoadedPipeline, height: int, width: int) -> tuple[int, int]:
    return flow.packed_latent_size(_vae_scale_factor(pipeline), height, width)


def _tokens(pipeline: LoadedPipeline, text: str) -> Any:
    tokenizer = flow.required_tokenizer(pipeline, "tokenizer")
    return tokenizer(
        [PROMPT_TEMPLATE.format(text)],
        max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_START,
        padding=True,
        truncation=True,
        return_tensors="pt",
    ).to(pipeline.device)


def _num_tokens(pipeline: LoadedPipeline, text: str, params: DiffusionParamsLike) -> int:
    length = _tokens(pipeline, text).input_ids.shape[1] - TEMPLATE_START
    return min(length, params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)


def _encode_text(pipeline: LoadedPipeline, text: str, params: DiffusionParamsLike) -> torch.Tensor:
    """``QwenImagePipeline.encode_prompt`` for one text (no padding, so no mask)."""
    tokens = _tokens(pipeline, text)
    out = pipeline.module("text_encoder")(
        input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
    )
    states = out.hidden_states[-1][0][TEMPLATE_START:]
    return states[: params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH].to(pipeline.dtype)


class QwenImageFamily(FamilyBase):
    name = "qwen_image"
    required = ("transformer", "vae", "text_encoder")
    label = "Qwen-Image"
    schedulers = (flow.FLOW_SCHEDULER,)

    def check(self, pipeline: LoadedPipeline) -> None:
        if pipeline.module("transformer").config.guidance_embeds:
            raise CheckpointError(
                f"{pipeline.folder}/transformer: guidance-distilled Qwen-Image transformers "
                "(guidance_embeds) are not served"
            )

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits:
        factor = _vae_scale_factor(pipeline)
        return flow.text_limits(
            pipeline,
            size_multiple=factor * 2,
            embedding_dim=int(pipeline.module("transformer").config.joint_attention_dim),
            native_size=DEFAULT_SAMPLE_SIZE * factor,
            max_sequence_length=TOKENIZER_MAX_LENGTH,
            default_guidance_scale=DEFAULT_GUIDANCE,
            param_aliases={"true_cfg_scale": "guidance_scale"},
        )

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        params = request.params
        height, width = _image_size(pipeline, params)
        cond = _num_tokens(pipeline, request.prompt or "", params)
        uncond = _num_tokens(pipeline, params.negative_prompt, params)
        return height, width, params.num_inference_steps, cond, params.uses_guidance and uncond

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        return flow.encode_prompts(request, functools.partial(_encode_text, pipeline))

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        height, width = _image_size(pipeline, request.params)
        latent_height, latent_width = _latent_size(pipeline, height, width)
        mu = flow.shift_of(pipeline.scheduler_config, (latent_height // 2) * (latent_width // 2))
        flow.set_flow_timesteps(scheduler, request.params.num_inference_steps, pipeline.device, mu)

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        """diffusers draws ``[1, 1, C, h, w]``: the same numbers as ``[1, C, h, w]``."""
        height, width = _image_size(pipeline, request.params)
        latent_height, latent_width = _latent_size(pipeline, height, width)
        channels = int(pipeline.module("transformer").config.in_channels) // 4
        return flow.draw_latents(pipeline, (1, channels, latent_height, latent_width), seed)

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        rows: list[flow.Guided[torch.Tensor]] = list(query.conditioning)  # [tokens, dim] each
        latent_height, latent_width = query.latents.shape[-2:]
        packed = flow.pack_latents(query.latents)
        num_rows = packed.shape[0]
        transformer = pipeline.module("transformer")
        shapes = [[(1, latent_height // 2, latent_width // 2)]] * num_rows
        timesteps = query.timestep.to(pipeline.device).expand(num_rows).to(packed.dtype) / 1000

        def run(states: list[torch.Tensor]) -> torch.Tensor:
            return transformer(
                hidden_states=packed,
                timestep=timesteps,
                guidance=None,
                encoder_hidden_states_mask=None,
                encoder_hidden_states=torch.stack(states),
                img_shapes=shapes,
                return_dict=False,
            )[0]

        noise = run([row.cond for row in rows])
        unconds = flow.unconditional_rows(rows)
        if unconds:
            combined = flow.guide(run(unconds), noise, query.guidance_scales)
            cond_norm = torch.norm(noise, dim=-1, keepdim=True)
            noise = combined * (cond_norm / torch.norm(combined, dim=-1, keepdim=True))
        return flow.unpack_latents(noise, latent_height, latent_width)

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        vae = pipeline.module("vae")
        latents = latents[:, :, None].to(vae.dtype)  # one frame
        z_dim = int(vae.config.z_dim)
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
        latents = latents / std.to(latents) + mean.to(latents)
        return flow.to_pixels(vae.decode(latents, return_dict=False)[0][:, :, 0])


FAMILY = QwenImageFamily()
