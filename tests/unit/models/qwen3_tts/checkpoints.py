"""A tiny Qwen3-TTS checkpoint folder written by the official ``qwen-tts`` package's own
classes: ``config.json`` and the talker's weights (randomised, so that its codes depend on
every weight), the speech tokenizer (``speech_tokenizer/``, its decoder randomised: a fresh one
decodes to silence), and a tokenizer (any: the tests' prompts are ids)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from omnistage.models.qwen3_tts.tiny import randomise_codec
from tests.qwen3_tts_reference import qwen_tts
from tests.unit.models.qwen3_tts.test_config import TEXT_VOCAB, write_folder


def write_talker(folder: Path, variant: str = "custom_voice", layers: int = 2):
    """``config.json`` and ``model.safetensors``: the reference model, returned."""
    qwen_tts()
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    from omnistage.models import tiny_ar
    from omnistage.models.qwen3_omni.tiny import build_tokenizer

    config = write_folder(folder, variant)
    config.talker_config.num_hidden_layers = layers
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.talker.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    # its weights as save_pretrained names them (which fails on transformers 5.25: the
    # package's _tied_weights_keys is a list where transformers now wants a dict)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # a Qwen-style tokenizer: <|im_start|>, <|im_end|> and each role one token, as the real
    # one's (the talker's prompt slices its role and end tokens off by count)
    build_tokenizer(TEXT_VOCAB).save(str(folder / "tokenizer.json"))
    tiny_ar.write_json(folder / "tokenizer_config.json", tiny_ar.tokenizer_config("", 4096))
    return model


ENCODER = dict(
    hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
    kernel_size=7, last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2,
    codebook_size=64, codebook_dim=16, num_quantizers=32, num_semantic_quantizers=1,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
    intermediate_size=32, sliding_window=250, frame_rate=12.5, sampling_rate=24000,
    upsample_groups=16, vector_quantization_hidden_dimension=16,
)  # fmt: skip
# head_dim: the heads are twice the hidden width wide, as in the published decoder
DECODER = dict(
    codebook_size=64, hidden_size=32, latent_dim=32, codebook_dim=16, num_attention_heads=2,
    num_key_value_heads=2, head_dim=32, sliding_window=8, num_hidden_layers=2,
    intermediate_size=64, num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
    decoder_dim=32,
)  # fmt: skip


def write_codec(folder: Path):
    """``speech_tokenizer/``: the tiny reference codec, randomised, saved; returned."""
    qwen_tts()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    config = Qwen3TTSTokenizerV2Config(
        encoder_config=ENCODER, decoder_config=DECODER, encoder_valid_num_quantizers=16
    )
    model = Qwen3TTSTokenizerV2Model(config).eval()
    randomise_codec(model, 0)  # the presets' randomisation
    model.save_pretrained(folder / "speech_tokenizer")
    return model
