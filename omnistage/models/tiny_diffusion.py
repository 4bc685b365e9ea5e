"""Tiny random-initialised image pipelines, saved as real diffusers-format folders.

Both presets use the PixArt-Sigma layout (``PixArtTransformer2DModel`` denoiser,
``AutoencoderKL``, flow-matching Euler scheduler), so ``diffusers`` itself can load them and
the engine loads them exactly like a downloaded checkpoint:

- ``image``: with a tiny T5 text encoder and a character-level tokenizer (built with the
  ``tokenizers`` library; no downloads), conditioned on text.
- ``image-cond``: no text encoder; conditioned on ``prompt_embeds`` of dimension 256, the
  demo AR thinker's hidden size, so the thinker's final hidden states feed it directly.

Builds are seeded and write no timestamps: the same preset gives the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

THINKER_HIDDEN_SIZE = 256


@dataclass(frozen=True)
class TinyDiffusionSpec:
    """Sizes of a tiny pipeline (defaults: the ``image`` preset, ~1.2 M + 1 M + 1 M params)."""

    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    caption_channels: int = THINKER_HIDDEN_SIZE
    sample_size: int = 16  # latent side; image side = sample_size * 2 ** (len(vae_channels) - 1)
    patch_size: int = 2
    latent_channels: int = 4
    vae_channels: tuple[int, ...] = (32, 64, 64)
    with_text_encoder: bool = True
    text_layers: int = 2
    max_sequence_length: int = 32
    scheduler: str = "FlowMatchEulerDiscreteScheduler"
    seed: int = 0


IMAGE = TinyDiffusionSpec()
IMAGE_COND = TinyDiffusionSpec(with_text_encoder=False, seed=1)


def build_char_tokenizer(max_length: int) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with T5's special tokens (pad 0, eos 1)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for code in range(32, 127):
        vocab.setdefault(chr(code).lower(), len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build_pipeline(out: str | Path, spec: TinyDiffusionSpec) -> Path:
    """Write a seeded random-init diffusers folder for ``spec`` into ``out``."""
    import diffusers
    from diffusers import AutoencoderKL, PixArtTransformer2DModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    components: dict[str, list[str | None]] = {
        "text_encoder": [None, None],
        "tokenizer": [None, None],
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        transformer: Any = PixArtTransformer2DModel(
            num_attention_heads=spec.num_heads,
            attention_head_dim=spec.head_dim,
            in_channels=spec.latent_channels,
            out_channels=spec.latent_channels,
            num_layers=spec.num_layers,
            sample_size=spec.sample_size,
            patch_size=spec.patch_size,
            caption_channels=spec.caption_channels,
            cross_attention_dim=spec.num_heads * spec.head_dim,
            norm_type="ada_norm_single",
        )
        transformer.save_pretrained(out / "transformer")
        components["transformer"] = ["diffusers", "PixArtTransformer2DModel"]
        num_blocks = len(spec.vae_channels)
        vae: Any = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * num_blocks,
            up_block_types=("UpDecoderBlock2D",) * num_blocks,
            block_out_channels=spec.vae_channels,
            layers_per_block=1,
            latent_channels=spec.latent_channels,
            norm_num_groups=16,
            sample_size=spec.sample_size * 2 ** (num_blocks - 1),
        )
        vae.save_pretrained(out / "vae")
        components["vae"] = ["diffusers", "AutoencoderKL"]
        if spec.with_text_encoder:
            from transformers import T5Config, T5EncoderModel

            tokenizer = build_char_tokenizer(spec.max_sequence_length)
            tokenizer.save_pretrained(out / "tokenizer")
            text_encoder = T5EncoderModel(
                T5Config(
                    vocab_size=len(tokenizer),
                    d_model=spec.caption_channels,
                    d_kv=spec.caption_channels // 4,
                    d_ff=spec.caption_channels * 2,
                    num_layers=spec.text_layers,
                    num_heads=4,
                    pad_token_id=0,
                    eos_token_id=1,
                )
            )
            text_encoder.save_pretrained(out / "text_encoder")
            components["text_encoder"] = ["transformers", "T5EncoderModel"]
            components["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    scheduler = getattr(diffusers, spec.scheduler)()
    scheduler.save_config(out / "scheduler")
    components["scheduler"] = ["diffusers", spec.scheduler]
    index = {
        "_class_name": "PixArtSigmaPipeline",
        "_diffusers_version": diffusers.__version__,
        **dict(sorted(components.items())),
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def build_image(out: str | Path) -> Path:
    """The ``image`` preset: text-conditioned, 64×64 images."""
    return build_pipeline(out, IMAGE)


def build_image_cond(out: str | Path) -> Path:
    """The ``image-cond`` preset: conditioned on 256-dim embeddings (thinker hidden states)."""
    return build_pipeline(out, IMAGE_COND)
