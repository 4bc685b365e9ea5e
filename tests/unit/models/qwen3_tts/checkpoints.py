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


SPEAKER = dict(
    mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8,
    enc_se_channels=8, enc_res2net_scale=8,
)  # fmt: skip
# the published encoder's layout, tiny: its quantizers project 16 -> 8 wide (512 -> 256 there)
BASE_ENCODER = dict(ENCODER, codebook_dim=8, vector_quantization_hidden_dimension=8)
PREPROCESSOR = dict(
    chunk_length_s=None, feature_extractor_type="EncodecFeatureExtractor", feature_size=1,
    overlap=None, padding_side="right", padding_value=0.0, return_attention_mask=True,
    sampling_rate=24000,
)  # fmt: skip


def write_base(folder: Path, layers: int = 2, greedy: bool = True):
    """A tiny Base checkpoint of the package's classes (its talker and speaker encoder random,
    its speech tokenizer with a Mimi encoder whose codebooks are random too, the published
    ``preprocessor_config.json``, a Qwen-style tokenizer); returns the package's
    ``Qwen3TTSModel`` over it, its speech tokenizer loaded as ``from_pretrained`` loads it."""
    import json

    qwen_tts()
    from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )
    from transformers import PreTrainedTokenizerFast

    from omnistage.models import tiny_ar
    from omnistage.models.qwen3_omni.tiny import build_tokenizer
    from omnistage.models.qwen3_tts.tiny import randomise_mimi_codebooks

    config = write_folder(folder, "base")
    config.talker_config.num_hidden_layers = layers
    config.speaker_encoder_config = Qwen3TTSSpeakerEncoderConfig(**SPEAKER)
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.talker.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
        for name, p in model.speaker_encoder.named_parameters():
            scale = 0.1 if name.endswith("bias") else p[0].numel() ** -0.5
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(TEXT_VOCAB).save(str(folder / "tokenizer.json"))
    tiny_ar.write_json(folder / "tokenizer_config.json", tiny_ar.tokenizer_config("", 4096))
    generation = {"do_sample": not greedy, "subtalker_dosample": not greedy}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    codec_config = Qwen3TTSTokenizerV2Config(
        encoder_config=BASE_ENCODER, decoder_config=DECODER, encoder_valid_num_quantizers=16
    )
    codec = Qwen3TTSTokenizerV2Model(codec_config).eval()
    randomise_codec(codec, 0)
    randomise_mimi_codebooks(codec.encoder, 1)
    codec.save_pretrained(folder / "speech_tokenizer")
    (folder / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    model.load_speech_tokenizer(Qwen3TTSTokenizer.from_pretrained(str(folder / "speech_tokenizer")))
    text = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|im_end|>"
    )  # padding=True asks for one (one text at a time: never used)
    return Qwen3TTSModel(model, Qwen3TTSProcessor(tokenizer=text), generation)


def module_name(flat: str) -> str:
    """A published speech-encoder name (Mimi's flat layout under ``encoder.``) as the
    package's module has it on transformers 5 (a nested ``MimiModel``)."""
    for before, after in (
        ("encoder.encoder.", "encoder.encoder.encoder_seanet."),
        ("encoder.encoder_transformer.", "encoder.encoder.encoder_transformer."),
        ("encoder.downsample.", "encoder.encoder.downsample."),
    ):
        if flat.startswith(before):
            return after + flat[len(before) :]
    return flat


def load_base(folder: Path):
    """The package's ``Qwen3TTSModel`` over a Base folder in the published layout (the tiny
    preset's): its model's state dict from ``model.safetensors``, its speech tokenizer as
    ``from_pretrained`` loads it — whose Mimi encoder, on transformers 5, reads none of the
    published flat names (they are renamed to its nested ones here)."""
    import json

    from safetensors.torch import load_file

    qwen_tts()
    from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
    from qwen_tts.core.models import (
        Qwen3TTSConfig,
        Qwen3TTSForConditionalGeneration,
        Qwen3TTSProcessor,
    )
    from transformers import PreTrainedTokenizerFast

    config = Qwen3TTSConfig(**json.loads((folder / "config.json").read_text()))
    model = Qwen3TTSForConditionalGeneration(config).eval()
    result = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not result.unexpected_keys and not [
        k for k in result.missing_keys if not k.endswith("inv_freq")
    ], result
    tokenizer = Qwen3TTSTokenizer.from_pretrained(str(folder / "speech_tokenizer"))
    flat = load_file(str(folder / "speech_tokenizer" / "model.safetensors"))
    encoder = {module_name(k): v for k, v in flat.items() if k.startswith("encoder.")}
    result = tokenizer.model.load_state_dict(encoder, strict=False)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if k.startswith("encoder.")]
    model.load_speech_tokenizer(tokenizer)
    text = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|im_end|>"
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    return Qwen3TTSModel(model, Qwen3TTSProcessor(tokenizer=text), generation)
