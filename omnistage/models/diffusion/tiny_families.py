"""Tiny random pipelines of the real image and video families, saved by diffusers itself.

Each preset builds the family's diffusers pipeline object from diffusers' and transformers'
own classes at tiny sizes (seeded; tokenizers from ``tiny_text``, nothing downloaded) and
writes it with ``save_pretrained``: the folder is exactly what ``DiffusionPipeline
.from_pretrained`` reads, so tests compare the stage with diffusers' ``__call__`` on it.

- ``tiny-flux``: ``FluxPipeline`` (CLIP + T5, guidance-distilled transformer, dynamic shift);
- ``tiny-sd3``: ``StableDiffusion3Pipeline`` (two CLIPs with projection + T5);
- ``tiny-qwen-image``: ``QwenImagePipeline`` (Qwen2.5-VL text encoder, 3-D causal VAE);
- ``tiny-wan``: ``WanPipeline`` (UMT5, Wan's 3-D VAE), text to video.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.models.diffusion.tiny_text import (
    TEXT_DIM,
    clip_text_encoder,
    clip_tokenizer,
    t5_text_encoder,
)
from omnistage.models.tiny_diffusion import build_char_tokenizer

T5_MAX_LENGTH = 64  # the tiny T5 tokenizers' model_max_length


def _save(pipe: Any, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    return out


def _shifted_vae(shift_factor: float, scaling_factor: float) -> Any:
    """A two-block ``AutoencoderKL`` with a shift factor (FLUX's and SD3's layout)."""
    from diffusers import AutoencoderKL

    vae: Any = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )
    return vae


def build_flux(out: str | Path) -> Path:
    """FLUX.1-dev's layout: latents packed 2x2, guidance embedded, dynamic shift."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10)
        tokenizer, tokenizer_2 = clip_tokenizer(), build_char_tokenizer(T5_MAX_LENGTH)
        vae = _shifted_vae(shift_factor=0.1159, scaling_factor=0.3611)
        transformer: Any = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_image_seq_len=256,
                max_image_seq_len=4096,
                base_shift=0.5,
                max_shift=1.15,
            ),
            vae=vae.eval(),
            text_encoder=clip_text_encoder(tokenizer),
            tokenizer=tokenizer,
            text_encoder_2=t5_text_encoder(tokenizer_2),
            tokenizer_2=tokenizer_2,
            transformer=transformer.eval(),
        )
    return _save(pipe, out)


def build_sd3(out: str | Path) -> Path:
    """Stable Diffusion 3's layout: two CLIPs with projection (token states side by side,
    padded to T5's width, then T5's states after them), classifier-free guidance."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer()
        tokenizer_3 = build_char_tokenizer(T5_MAX_LENGTH)
        vae = _shifted_vae(shift_factor=0.0609, scaling_factor=1.5035)
        transformer: Any = SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=2 * TEXT_DIM,
            caption_projection_dim=32,
            pooled_projection_dim=2 * TEXT_DIM,
            out_channels=4,
            pos_embed_max_size=32,
        )
        pipe = StableDiffusion3Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae.eval(),
            text_encoder=clip_text_encoder(tokenizer, with_projection=True),
            tokenizer=tokenizer,
            text_encoder_2=clip_text_encoder(tokenizer_2, with_projection=True),
            tokenizer_2=tokenizer_2,
            text_encoder_3=t5_text_encoder(tokenizer_3, d_model=2 * TEXT_DIM),
            tokenizer_3=tokenizer_3,
            transformer=transformer.eval(),
        )
    return _save(pipe, out)


def build_qwen_image(out: str | Path) -> Path:
    """Qwen-Image's layout: a Qwen2.5-VL text encoder, latents packed 2x2, a causal 3-D VAE
    (one frame), true classifier-free guidance with norm rescaling."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from omnistage.models.diffusion.tiny_text import qwen2_5_vl_text_encoder, qwen_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12)
        tokenizer = qwen_tokenizer()
        vae: Any = AutoencoderKLQwenImage(
            base_dim=16,
            z_dim=4,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.0, 0.3],
            latents_std=[1.5, 0.8, 1.0, 2.0],
        )
        transformer: Any = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        )
        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=1.0,
                use_dynamic_shifting=True,
                base_image_seq_len=256,
                max_image_seq_len=8192,
                base_shift=0.5,
                max_shift=0.9,
                shift_terminal=0.02,
                time_shift_type="exponential",
            ),
            vae=vae.eval(),
            text_encoder=qwen2_5_vl_text_encoder(tokenizer),
            tokenizer=tokenizer,
            transformer=transformer.eval(),
        )
    return _save(pipe, out)


WAN_LATENT_CHANNELS = 16


def build_wan(out: str | Path) -> Path:
    """Wan 2.1 text-to-video's layout: a UMT5 text encoder, a 3-D transformer with (1, 2, 2)
    patches, Wan's causal 3-D VAE (8x spatial, 4x temporal: three down blocks, the last two
    also in time) and, as the released Wan 2.1 folders ship, a UniPC multistep scheduler
    predicting flow."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(13)
        tokenizer = build_char_tokenizer(T5_MAX_LENGTH)
        vae: Any = AutoencoderKLWan(
            base_dim=8,
            z_dim=WAN_LATENT_CHANNELS,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.05 * (i - 8) for i in range(WAN_LATENT_CHANNELS)],
            latents_std=[1.0 + 0.1 * i for i in range(WAN_LATENT_CHANNELS)],
        )
        transformer: Any = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=WAN_LATENT_CHANNELS,
            out_channels=WAN_LATENT_CHANNELS,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=48,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        pipe = WanPipeline(
            tokenizer=tokenizer,
            text_encoder=t5_text_encoder(tokenizer, umt5=True),
            vae=vae.eval(),
            scheduler=UniPCMultistepScheduler(
                prediction_type="flow_prediction",
                use_flow_sigmas=True,
                flow_shift=3.0,
                num_train_timesteps=1000,
            ),
            transformer=transformer.eval(),
        )
    return _save(pipe, out)
