"""Tiny random-initialised Qwen2.5-Omni checkpoints, built with transformers' own classes.

``build_tiny_qwen2_5_omni`` constructs ``transformers.Qwen2_5OmniForConditionalGeneration``
from a small ``Qwen2_5OmniConfig`` (sizes in ``tiny_specs``), randomises every parameter from
a seeded generator and writes what the real ``Qwen/Qwen2.5-Omni-*`` folders hold: config,
safetensors, ``spk_dict.pt`` voices (``speakers``), a trained byte-level BPE tokenizer with the
chat template, the preprocessor config. ``build``, ``build_alt`` and ``build_bench`` build the
specs ``DEFAULT``, ``ALT`` and ``BENCH``. Same spec and seed → byte-identical files.

See docs/qwen-omni.md, "The tiny checkpoint" (where it departs from the real proportions), and
docs/adding-a-model.md, "A family of several parts" (what a tiny builder writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from omnistage.models import omni_tiny, tiny_ar
from omnistage.models.qwen2_5_omni.tiny_specs import (  # noqa: F401  (re-exported)
    ALT,
    BENCH,
    DEFAULT,
    TINY_QWEN_OMNI_SPECS,
    TinyQwenOmniSpec,
)

# The Qwen2.5-Omni tokenizer's special tokens that the configs point to, in id order (ids
# 0, 1, 2, ...), then the two voices' text-side start tokens.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|tts_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eod|>",
    "<|tts_bos_chelsie|>",
    "<|tts_bos_ethan|>",
)
VOICES: dict[str, str] = {"Chelsie": "<|tts_bos_chelsie|>", "Ethan": "<|tts_bos_ethan|>"}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# Qwen2.5-Omni's own chat template (the real folder's): one placeholder per audio, image and
# video part, framed by its start and end tokens, and a default system message.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    + DEFAULT_SYSTEM_PROMPT
    + "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The real folder's preprocessor_config.json (Whisper features, Qwen2-VL images), with
# max_pixels lowered (50176 = 224 x 224, 64 image tokens) so that test images stay small.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    **omni_tiny.PREPROCESSOR_COMMON,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": 224 * 224,
    "patch_size": 14,
    "processor_class": "Qwen2_5OmniProcessor",
}
WAVEFORM_GAIN = 0.2  # BigVGAN's last conv: keeps most samples inside its [-1, 1] clamp
_BIGVGAN_OUT = "token2wav.code2wav_bigvgan_model.conv_post.weight"


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, ``SPECIAL_TOKENS`` first."""
    return tiny_ar.build_tokenizer(
        vocab_size, seed, SPECIAL_TOKENS, extra_lines=(DEFAULT_SYSTEM_PROMPT,) * 8
    )


def token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Every special token's id (they are the first ids, in ``SPECIAL_TOKENS`` order)."""
    return omni_tiny.special_token_ids(tokenizer, SPECIAL_TOKENS)


def hf_config(spec: TinyQwenOmniSpec, ids: dict[str, int]) -> Any:
    """The ``Qwen2_5OmniConfig`` for ``spec`` whose token ids are ``ids`` (see ``token_ids``)."""
    from transformers import Qwen2_5OmniConfig

    for name in ("codec_pad_id", "codec_bos_id", "codec_eos_id", "codec_mask_id"):
        if not 0 <= getattr(spec, name) < spec.talker_vocab_size:
            raise ValueError(f"{name} {getattr(spec, name)} is outside the talker vocabulary")
    multimodal_ids = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
    }
    text_config = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.mrope_section),
        },
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": None,
    }
    # The smallest encoders transformers accepts (the vision one's output is the thinker's
    # width; 128 mel bins as the feature extractor makes).
    audio_config = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "d_model": 16,
        "output_dim": spec.hidden_size,
        "max_source_positions": 1500,
        "n_window": 100,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": spec.hidden_size,
        "fullatt_block_indexes": [0],
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        "user_token_id": ids["<|im_start|>"],
        # Not fields of Qwen2_5OmniThinkerConfig, but the thinker's get_rope_index reads them
        # (the real config.json has them too): without them generate raises AttributeError.
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "tie_word_embeddings": spec.tie_word_embeddings,
        **multimodal_ids,
    }
    talker_config = {
        "vocab_size": spec.talker_vocab_size,
        "embedding_size": spec.hidden_size,  # talker inputs are thinker embeddings
        "hidden_size": spec.talker_hidden_size,
        "intermediate_size": spec.talker_intermediate_size,
        "num_hidden_layers": spec.talker_num_layers,
        "num_attention_heads": spec.talker_num_heads,
        "num_key_value_heads": spec.talker_num_kv_heads,
        "head_dim": spec.talker_head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.talker_num_layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.talker_mrope_section),
        },
        "tts_codec_start_token_id": spec.codec_bos_id,
        "tts_codec_end_token_id": spec.codec_eos_id,
        "tts_codec_pad_token_id": spec.codec_pad_id,
        "tts_codec_mask_token_id": spec.codec_mask_id,
        "tts_text_start_token_id": ids["<|tts_text_bos|>"],
        "tts_text_end_token_id": ids["<|tts_text_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        **multimodal_ids,
    }
    dit_config = {
        "hidden_size": spec.dit_hidden_size,
        "num_hidden_layers": spec.dit_num_layers,
        "num_attention_heads": spec.dit_num_heads,
        "head_dim": spec.dit_head_dim,
        "ff_mult": spec.dit_ff_mult,
        "emb_dim": spec.dit_emb_dim,
        "max_position_embeddings": spec.dit_max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "block_size": spec.dit_block_size,
        "look_ahead_layers": list(spec.dit_look_ahead_layers),
        "look_backward_layers": list(spec.dit_look_backward_layers),
        "repeats": spec.dit_repeats,
        "num_embeds": spec.talker_vocab_size,
        "mel_dim": spec.mel_dim,
        "dropout": 0.0,
        "enc_emb_dim": spec.enc_emb_dim,
        "enc_dim": spec.enc_dim,
        "enc_channels": list(spec.enc_channels),
        "enc_kernel_sizes": list(spec.enc_kernel_sizes),
        "enc_dilations": list(spec.enc_dilations),
        "enc_attention_channels": spec.enc_attention_channels,
        "enc_res2net_scale": 2,
        "enc_se_channels": spec.enc_se_channels,
    }
    bigvgan_config = {
        "mel_dim": spec.mel_dim,
        "upsample_initial_channel": spec.bigvgan_initial_channel,
        "resblock_kernel_sizes": list(spec.resblock_kernel_sizes),
        "resblock_dilation_sizes": [list(d) for d in spec.resblock_dilation_sizes],
        "upsample_rates": list(spec.upsample_rates),
        "upsample_kernel_sizes": list(spec.upsample_kernel_sizes),
    }
    config = Qwen2_5OmniConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        token2wav_config={"dit_config": dit_config, "bigvgan_config": bigvgan_config},
        enable_audio_output=True,
    )
    config.dtype = torch.float32
    return config


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a generator seeded with ``seed`` (``omni_tiny.randomise``): norm
    weights N(1, 0.1); matrices and kernels N(0, 1 / fan_in) (signals keep their scale through
    every part, so the waveform depends on the codes and greedy decoding does not collapse);
    the rest (biases, SnakeBeta's log-scales) N(0, 0.05^2). BigVGAN's output conv is scaled by
    ``WAVEFORM_GAIN``."""
    omni_tiny.randomise(model, seed, {_BIGVGAN_OUT: WAVEFORM_GAIN})


def speakers(spec: TinyQwenOmniSpec, ids: dict[str, int], seed: int) -> dict[str, dict[str, Any]]:
    """The voices of ``spk_dict.pt``: ``cond`` [1, enc_emb_dim], ``ref_mel`` [1, T, mel_dim]
    (log-mel-like values), ``bos_token`` an id in the thinker vocabulary."""
    generator = torch.Generator().manual_seed(seed + 1)
    voices = {}
    for name, token in VOICES.items():
        cond = torch.randn(1, spec.enc_emb_dim, generator=generator)
        ref_mel = torch.randn(1, spec.ref_mel_frames, spec.mel_dim, generator=generator) - 5.0
        voices[name] = {"cond": cond, "ref_mel": ref_mel, "bos_token": ids[token]}
    return voices


def build_tiny_qwen2_5_omni(
    out: str | Path, spec: TinyQwenOmniSpec = DEFAULT, seed: int = 0
) -> Path:
    """Write a complete tiny Qwen2.5-Omni checkpoint for ``spec`` into the folder ``out``."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    tokenizer = build_tokenizer(spec.vocab_size, seed)
    ids = token_ids(tokenizer)
    # The thinker's text stops where transformers' thinker stops: its generation config comes
    # from text_config, whose only eos is <|im_end|>.
    out = omni_tiny.write_folder(
        out,
        tokenizer,
        ids,
        chat_template=CHAT_TEMPLATE,
        max_len=spec.max_position_embeddings,
        make=lambda: Qwen2_5OmniForConditionalGeneration(hf_config(spec, ids)),
        randomise=randomise,
        seed=seed,
        max_shard_size=spec.max_shard_size,
        preprocessor_config=PREPROCESSOR_CONFIG,
    )
    torch.save(speakers(spec, ids, seed), out / "spk_dict.pt")
    return out


def build(out: str | Path) -> Path:
    """The ``tiny-qwen2.5-omni`` preset (spec ``DEFAULT``, seed 0)."""
    return build_tiny_qwen2_5_omni(out, DEFAULT)


def build_alt(out: str | Path) -> Path:
    """The second tiny config (spec ``ALT``: other sizes, tied thinker embeddings, one shard)."""
    return build_tiny_qwen2_5_omni(out, ALT)


def build_bench(out: str | Path) -> Path:
    """The ``bench-qwen2.5-omni`` preset (spec ``BENCH``: bench-size, one shard, seed 0)."""
    return build_tiny_qwen2_5_omni(out, BENCH)
