"""Tiny random-initialised Qwen3-Omni checkpoints, built with transformers' own classes.

``build_tiny_qwen3_omni`` constructs ``transformers.Qwen3OmniMoeForConditionalGeneration``
from a small ``Qwen3OmniMoeConfig`` (sizes in ``tiny_specs``), randomises every parameter from
a seeded generator (``randomise``, with the ``GAINS``) and writes what the real
``Qwen/Qwen3-Omni-30B-A3B-Instruct`` folder holds: config, safetensors, a trained byte-level
BPE tokenizer with the chat template, the preprocessor config. Same spec and seed →
byte-identical files.

See docs/qwen3-omni.md, "The tiny checkpoint" (its sizes, talker vocabulary and tokenizer),
and docs/adding-a-model.md, "A family of several parts" (what a tiny builder writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from omnistage.models import omni_tiny, tiny_ar
from omnistage.models.qwen3_omni.tiny_specs import (  # noqa: F401  (re-exported)
    DEFAULT,
    TINY_QWEN3_OMNI_SPECS,
    TinyQwen3OmniSpec,
)

# The Qwen3-Omni tokenizer's special tokens that the configs and the processor use, in the
# real ids' order (151643, 151644, 151645, 151652-151656, 151669-151675), as ids 0, 1, 2, ...
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
ROLES: tuple[str, ...] = ("system", "user", "assistant")  # one BPE token each
# The processor's names for its media tokens (the real tokenizer_config.json's).
MEDIA_TOKENS: dict[str, str] = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
VOICES: tuple[str, ...] = ("Chelsie", "Ethan", "Aiden")  # generate(speaker=...) lower-cases
# Qwen3-Omni's chat template without tools and thinking: one placeholder per audio, image and
# video part, framed by its start and end tokens; no default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The real folder's preprocessor_config.json (Whisper features, Qwen2-VL images in 16-pixel
# patches), with max_pixels lowered (65536 = 256 x 256, at most 64 image tokens).
PREPROCESSOR_CONFIG: dict[str, Any] = {
    **omni_tiny.PREPROCESSOR_COMMON,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_pixels": 256 * 256,
    "patch_size": 16,
    "processor_class": "Qwen3OmniMoeProcessor",
}
POSITION_ID_PER_SECONDS = 13  # the real config's (thinker and talker)
WAVEFORM_GAIN = 0.05  # code2wav's last conv: std ~0.3, most samples inside its [-1, 1] clamp
# The experts' output matrices (thinker and talker): the top-2 average halves one expert's
# output, and without x2 the residual stream dominates and greedy thinkers repeat one token
# (2-7 distinct in 16 on the standard prompts; with it 8-10 in 10).
EXPERT_GAIN = 2.0
# The thinker -> talker projections' output layers: without it the four summed codec
# embeddings outweigh the projected text and a random talker repeats one code; x4 gives
# 13-15 distinct first-codebook codes in 24 frames on the standard prompts.
TEXT_GAIN = 4.0
GAINS = {
    "talker.text_projection.linear_fc2.weight": TEXT_GAIN,
    "talker.hidden_projection.linear_fc2.weight": TEXT_GAIN,
}


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, ``SPECIAL_TOKENS`` first,
    each of ``ROLES`` one token."""
    tokenizer = tiny_ar.build_tokenizer(vocab_size, seed, SPECIAL_TOKENS, extra_lines=ROLES * 200)
    for role in ROLES:
        if len(tokenizer.encode(role).ids) != 1:
            raise ValueError(f"the tiny tokenizer splits the role {role!r}")
    return tokenizer


def token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The id of every special token and role (specials are the first ids, in order)."""
    ids = omni_tiny.special_token_ids(tokenizer, SPECIAL_TOKENS)
    for role in ROLES:
        ids[role] = tokenizer.encode(role).ids[0]
    return ids


def hf_config(spec: TinyQwen3OmniSpec, ids: dict[str, int]) -> Any:
    """The ``Qwen3OmniMoeConfig`` for ``spec`` whose token ids are ``ids`` (``token_ids``)."""
    from transformers import Qwen3OmniMoeConfig

    if not 0 < spec.accept_hidden_layer < spec.num_layers:
        raise ValueError("accept_hidden_layer must name a middle thinker layer")
    if any(not 0 <= i < spec.vision_depth for i in spec.deepstack_visual_indexes):
        raise ValueError("deepstack_visual_indexes must lie inside the vision depth")
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        # not fields of the config classes, but in the real config.json
        "audio_end_token_id": ids["<|audio_end|>"],
        "position_id_per_seconds": POSITION_ID_PER_SECONDS,
        "seconds_per_chunk": 2,
    }

    def rope(section: tuple[int, int, int], **extra: Any) -> dict[str, Any]:
        return {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(section),
            "interleaved": True,
            **extra,
        }

    text_config = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": 0,
        "use_qk_norm": True,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope(spec.mrope_section, mrope_interleaved=True),
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    audio_config = {
        "num_mel_bins": 128,
        "encoder_layers": spec.audio_layers,
        "encoder_attention_heads": spec.audio_heads,
        "encoder_ffn_dim": spec.audio_ffn,
        "d_model": spec.audio_d_model,
        "downsample_hidden_size": spec.audio_downsample,
        "output_dim": spec.hidden_size,
        "max_source_positions": 1500,
        "n_window": spec.audio_n_window,
        "n_window_infer": spec.audio_n_window_infer,
    }
    vision_config = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_heads": spec.vision_heads,
        "patch_size": spec.vision_patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": spec.hidden_size,
        "num_position_embeddings": spec.vision_position_embeddings,
        "deepstack_visual_indexes": list(spec.deepstack_visual_indexes),
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        "user_token_id": ids["user"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        **media,
    }
    talker_text = {
        "vocab_size": spec.talker_vocab_size,
        "hidden_size": spec.talker_hidden_size,
        "intermediate_size": spec.talker_intermediate_size,
        "num_hidden_layers": spec.talker_num_layers,
        "num_attention_heads": spec.talker_num_heads,
        "num_key_value_heads": spec.talker_num_kv_heads,
        "head_dim": spec.talker_head_dim,
        "num_experts": spec.talker_num_experts,
        "num_experts_per_tok": spec.talker_num_experts_per_tok,
        "moe_intermediate_size": spec.talker_moe_intermediate_size,
        "shared_expert_intermediate_size": spec.talker_shared_expert_intermediate_size,
        "norm_topk_prob": True,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope(spec.talker_mrope_section),
    }
    predictor = {
        "vocab_size": spec.codebook_size,
        "hidden_size": spec.talker_hidden_size,
        "intermediate_size": spec.predictor_intermediate_size,
        "num_hidden_layers": spec.predictor_num_layers,
        "num_attention_heads": spec.predictor_num_heads,
        "num_key_value_heads": spec.predictor_num_kv_heads,
        "head_dim": spec.predictor_head_dim,
        "num_code_groups": spec.num_code_groups,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
    }
    talker_config = {
        "text_config": talker_text,
        "code_predictor_config": predictor,
        "num_code_groups": spec.num_code_groups,
        "thinker_hidden_size": spec.hidden_size,
        "accept_hidden_layer": spec.accept_hidden_layer,
        "speaker_id": spec.speaker_ids,
        "spatial_merge_size": 2,  # read by the talker, not a config field
        **spec.codec_ids,
        **media,
    }
    code2wav_config = {
        "codebook_size": spec.codebook_size,
        "hidden_size": spec.code2wav_hidden_size,
        "intermediate_size": spec.code2wav_intermediate_size,
        "num_hidden_layers": spec.code2wav_num_layers,
        "num_attention_heads": spec.code2wav_num_heads,
        "num_key_value_heads": spec.code2wav_num_heads,
        "sliding_window": spec.code2wav_sliding_window,
        "num_quantizers": spec.num_code_groups,
        "upsample_rates": list(spec.upsample_rates),
        "upsampling_ratios": list(spec.upsampling_ratios),
        "decoder_dim": spec.decoder_dim,
        "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        code2wav_config=code2wav_config,
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )
    config.dtype = torch.float32
    return config


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a generator seeded with ``seed`` (``omni_tiny.randomise``): norm
    weights N(1, 0.1); matrices and kernels N(0, 1 / fan_in) (expert banks [E, out, in]:
    fan_in = in), so signals keep their scale through every part, the waveform depends on the
    codes and greedy decoding does not collapse; the rest (biases, layer scales, SnakeBeta's
    log-scales) N(0, 0.05^2). code2wav's output conv is scaled by ``WAVEFORM_GAIN``, the
    talker's text and hidden projections' outputs by ``TEXT_GAIN``, the experts' down
    projections by ``EXPERT_GAIN``."""
    gains = {**GAINS, _last_decoder_conv(model): WAVEFORM_GAIN}
    omni_tiny.randomise(model, seed, gains, expert_gain=EXPERT_GAIN)


def _last_decoder_conv(model: torch.nn.Module) -> str:
    names = [n for n, _ in model.named_parameters() if n.startswith("code2wav.decoder.")]
    return [n for n in names if n.endswith("conv.weight")][-1]


def build_tiny_qwen3_omni(
    out: str | Path, spec: TinyQwen3OmniSpec = DEFAULT, seed: int = 0
) -> Path:
    """Write a complete tiny Qwen3-Omni checkpoint for ``spec`` into the folder ``out``."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_tokenizer(spec.vocab_size, seed)
    ids = token_ids(tokenizer)
    # The thinker stops at <|im_end|> (generate's own default, thinker_eos_token_id=151645, is
    # the real vocabulary's id: pass the config's im_end_token_id instead).
    return omni_tiny.write_folder(
        out,
        tokenizer,
        ids,
        chat_template=CHAT_TEMPLATE,
        max_len=spec.max_position_embeddings,
        make=lambda: Qwen3OmniMoeForConditionalGeneration(hf_config(spec, ids)),
        randomise=randomise,
        seed=seed,
        max_shard_size=spec.max_shard_size,
        preprocessor_config=PREPROCESSOR_CONFIG,
        extra_special_tokens=MEDIA_TOKENS,
    )


def build(out: str | Path) -> Path:
    """The ``tiny-qwen3-omni`` preset (spec ``DEFAULT``, seed 0)."""
    return build_tiny_qwen3_omni(out, DEFAULT)
