"""Tiny random Qwen3-TTS checkpoints (presets ``tiny-qwen3-tts-customvoice``,
``tiny-qwen3-tts-voicedesign`` and ``tiny-qwen3-tts-base``; ``bench-qwen3-tts-customvoice``,
wider and deeper for ``omnistage bench tts``, never ending an utterance before its bound),
written by omnistage's own modules in the
published layout: ``config.json`` and ``generation_config.json``, the talker's
weights under the names ``Qwen3TTSForConditionalGeneration`` saves (its tests check them
against the package's own classes), a Qwen-style tokenizer, and ``speech_tokenizer/`` with the
decoder's weights and its ``preprocessor_config.json``. The Base checkpoint adds its speaker
encoder (``speaker_encoder.*``) and the speech tokenizer's Mimi encoder (``encoder.*``, the
published flat names, its codebooks random too). Seeded: same bytes each build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omnistage.models import omni_tiny, tiny_ar

TEXT_VOCAB = 512
CODEBOOK = 64
GROUPS = 16
SPECIAL_CODEC = {
    "codec_pad_id": 1000, "codec_bos_id": 1001, "codec_eos_token_id": 1002,
    "codec_think_id": 1003, "codec_nothink_id": 1004, "codec_think_bos_id": 1005,
    "codec_think_eos_id": 1006,
}  # fmt: skip
SPEAKERS = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee")
DIALECTS = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
LANGUAGES = (
    "chinese", "english", "japanese", "korean", "german", "french", "russian", "portuguese",
    "spanish", "italian", "beijing_dialect", "sichuan_dialect",
)  # fmt: skip
DECODER = {
    "codebook_size": CODEBOOK, "hidden_size": 32, "latent_dim": 32, "codebook_dim": 16,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 8,
    "num_hidden_layers": 2, "intermediate_size": 64, "num_quantizers": GROUPS,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32,
}  # fmt: skip


# the speech tokenizer's Mimi encoder: the published one's layout, tiny (its quantizers
# project 16 -> 8 wide, as the published 512 -> 256)
ENCODER: dict[str, Any] = {
    "model_type": "mimi", "hidden_size": 16, "num_filters": 4, "num_residual_layers": 1,
    "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
    "residual_kernel_size": 3, "dilation_growth_rate": 2, "codebook_size": CODEBOOK,
    "codebook_dim": 8, "vector_quantization_hidden_dimension": 8, "num_quantizers": 32,
    "num_semantic_quantizers": 1, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32, "sliding_window": 250,
    "frame_rate": 12.5, "sampling_rate": 24000, "upsample_groups": 16, "use_causal_conv": True,
}  # fmt: skip
SPEAKER_ENCODER = {
    "mel_dim": 128, "enc_dim": 32, "enc_channels": [16, 16, 16, 16, 48],
    "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 8, "enc_res2net_scale": 8, "enc_se_channels": 8,
    "sample_rate": 24000,
}  # fmt: skip
# the published speech tokenizer's feature extractor (the package's encode reads it)
PREPROCESSOR = {
    "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1, "overlap": None, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": True, "sampling_rate": 24000,
}  # fmt: skip


# bench-size: the talker's and the decoder's widths and depths cut down from the published
# 0.6B's (talker 1024 wide, 28 layers; code predictor 5 layers; decoder 8 layers, 1536 wide)
BENCH_TALKER = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "text_hidden_size": 256,
}  # fmt: skip
BENCH_PREDICTOR = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
}  # fmt: skip
BENCH_DECODER = {
    **DECODER, "hidden_size": 128, "latent_dim": 256, "codebook_dim": 64, "head_dim": 64,
    "sliding_window": 72, "intermediate_size": 256, "decoder_dim": 256,
}  # fmt: skip


def configs(variant: str, text_ids: dict[str, int], bench: bool = False) -> dict[str, Any]:
    """``config.json`` of a tiny checkpoint of ``variant`` (``bench``: the bench size)."""
    talker = {
        "vocab_size": 1024 + CODEBOOK, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "text_vocab_size": TEXT_VOCAB, "text_hidden_size": 24,
        "num_code_groups": GROUPS, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
        "code_predictor_config": {
            "vocab_size": CODEBOOK, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "num_code_groups": GROUPS, "rope_theta": 10000,
        },
        **SPECIAL_CODEC,
    }  # fmt: skip
    if bench:
        talker.update(BENCH_TALKER)
        talker["code_predictor_config"].update(BENCH_PREDICTOR)  # type: ignore[attr-defined]
    talker["spk_id"], talker["spk_is_dialect"] = {}, {}  # a designed voice has no names
    if variant == "custom_voice":  # the published CustomVoice's speakers, as clients name them
        talker["spk_id"] = {name: 1010 + i for i, name in enumerate(SPEAKERS)}
        talker["spk_is_dialect"] = {name: DIALECTS.get(name, False) for name in SPEAKERS}
    talker["codec_language_id"] = {name: 1030 + i for i, name in enumerate(LANGUAGES)}
    raw = {
        "model_type": "qwen3_tts",
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "tts_model_type": variant,
        "tts_model_size": "1b7",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "talker_config": talker,
        **text_ids,
    }
    if variant == "base":
        raw["speaker_encoder_config"] = dict(SPEAKER_ENCODER)
    return raw


def _talker_weights(raw: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Our talker, randomised, under the checkpoint's names (``talker.*``)."""
    from omnistage.models.qwen3_tts.talker import TALKER_PREFIXES, Talker, talker_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Talker(talker_config(raw), torch.float32)
    omni_tiny.randomise(model, seed, {})
    back = {dst: src for src, dst in TALKER_PREFIXES.items() if src != "model."}
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        prefix = next((p for p in back if name.startswith(p)), "model.")
        source = back.get(prefix, "model.")
        out["talker." + source + name[len(prefix) :]] = tensor.contiguous()
    return out


@torch.no_grad()
def randomise_codec(model: torch.nn.Module, seed: int) -> None:
    """A speech tokenizer's weights from a generator seeded with ``seed`` (a fresh one decodes
    to silence): the codebooks' sums normal, their usage positive (as a trained codebook's),
    SnakeBeta's log-scales ``alpha``/``beta`` normal(0, 0.1), the rest normal(0, 0.2) around
    their initial values."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("embedding_sum"):
            param.copy_(noise)
        elif name.endswith("cluster_usage"):
            param.copy_(0.5 + noise.abs())
        elif name.endswith((".alpha", ".beta")):
            param.copy_(0.1 * noise)
        else:
            param.add_(0.2 * noise)


def _decoder_weights(raw: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Our speech decoder, randomised so that it speaks (a fresh codebook is silence)."""
    from omnistage.models.qwen3_tts.code2wav import SpeechDecoder, decoder_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SpeechDecoder(decoder_config(raw, "speech_tokenizer/config.json"))
    randomise_codec(model, seed)
    return {f"decoder.{k}": v.contiguous() for k, v in model.state_dict().items()}


@torch.no_grad()
def randomise_mimi_codebooks(model: torch.nn.Module, seed: int) -> None:
    """A Mimi encoder's codebooks (buffers, which ``randomise_codec`` leaves: a fresh one is
    all zeros, every frame code 0) from a generator seeded with ``seed``: sums normal, usage
    positive."""
    generator = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("embed_sum"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        elif name.endswith("cluster_usage"):
            buffer.copy_(0.5 + torch.randn(buffer.shape, generator=generator).abs())


def _encoder_weights(seed: int) -> dict[str, torch.Tensor]:
    """A Mimi encoder, randomised, under the published names (``encoder.*``)."""
    from transformers import MimiConfig, MimiModel

    from omnistage.models.qwen3_tts.codec_encoder import published_name

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MimiModel(MimiConfig(**{k: v for k, v in ENCODER.items() if k != "model_type"}))
    model.decoder = None
    randomise_codec(model, seed)
    randomise_mimi_codebooks(model, seed + 1)
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, mod in model.named_modules()
        for name in getattr(mod, "_non_persistent_buffers_set", set())
    }
    return {
        published_name(k): v.contiguous()
        for k, v in model.state_dict().items()
        if k not in non_persistent
    }


def _speaker_weights(seed: int) -> dict[str, torch.Tensor]:
    """The speaker encoder (transformers' ECAPA-TDNN, the package's in name and shape),
    randomised, under ``speaker_encoder.*``."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import ECAPA_TimeDelayNet

    from omnistage.models.qwen3_tts.speaker import encoder_config

    config = encoder_config({"speaker_encoder_config": SPEAKER_ENCODER}, "tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ECAPA_TimeDelayNet(config)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if name.endswith("bias") else param[0].numel() ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return {f"speaker_encoder.{k}": v.contiguous() for k, v in model.state_dict().items()}


def build(
    out: str | Path, variant: str = "custom_voice", seed: int = 0, bench: bool = False
) -> Path:
    from omnistage.models.qwen3_omni.tiny import build_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TEXT_VOCAB, seed)
    tokenizer.save(str(out / "tokenizer.json"))
    tiny_ar.write_json(out / "tokenizer_config.json", tiny_ar.tokenizer_config("", 4096))
    ids = omni_tiny.special_token_ids(tokenizer, ("<|im_start|>", "<|im_end|>"))
    text_ids = {
        "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": TEXT_VOCAB - 3, "tts_bos_token_id": TEXT_VOCAB - 2,
        "tts_eos_token_id": TEXT_VOCAB - 1,
    }  # fmt: skip
    raw = configs(variant, text_ids, bench)
    tiny_ar.write_json(out / "config.json", raw)
    tiny_ar.write_json(out / "generation_config.json", {"max_new_tokens": 256})
    weights = _talker_weights(raw, seed)
    if bench:  # the codec end's logit 0, under every frame's best code: speaks to the bound
        weights["talker.codec_head.weight"][SPECIAL_CODEC["codec_eos_token_id"]] = 0.0
    if variant == "base":
        weights.update(_speaker_weights(seed + 2))
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    tok = out / "speech_tokenizer"
    tok.mkdir(exist_ok=True)
    codec = {
        "model_type": "qwen3_tts_tokenizer_12hz",
        "decoder_config": BENCH_DECODER if bench else DECODER,
        "encoder_valid_num_quantizers": GROUPS, "input_sample_rate": 24000,
        "output_sample_rate": 24000, "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
    }  # fmt: skip
    codec_weights = _decoder_weights(codec, seed + 1)
    tiny_ar.write_json(tok / "preprocessor_config.json", PREPROCESSOR)
    if variant == "base":
        codec["encoder_config"] = dict(ENCODER)
        codec_weights.update(_encoder_weights(seed + 3))
    tiny_ar.write_json(tok / "config.json", codec)
    save_file(codec_weights, str(tok / "model.safetensors"), {"format": "pt"})
    return out


def build_custom_voice(out: str | Path) -> Path:
    return build(out, "custom_voice")


def build_voice_design(out: str | Path) -> Path:
    return build(out, "voice_design")


def build_base(out: str | Path) -> Path:
    return build(out, "base")


def build_bench(out: str | Path) -> Path:
    """``bench-qwen3-tts-customvoice``: CustomVoice at the bench size."""
    return build(out, "custom_voice", bench=True)
