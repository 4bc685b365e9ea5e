"""The tiny Qwen3-TTS presets: written by our own modules in the published layout — the
talker's tensors are exactly those the official ``qwen-tts`` package's
``Qwen3TTSForConditionalGeneration`` has, in name and shape, and the speech tokenizer's decoder
tensors its ``Qwen3TTSTokenizerV2Model``'s decoder has; the same bytes each build; and the
built-in pipeline speaks through the family's speech prompt."""

from __future__ import annotations

import hashlib
import json

import pytest
from safetensors import safe_open

from omnistage.models.tiny import build_preset
from tests.qwen3_tts_reference import qwen_tts


def shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module", params=["customvoice", "voicedesign"])
def preset(request, tmp_path_factory):
    name = f"tiny-qwen3-tts-{request.param}"
    return name, build_preset(name, tmp_path_factory.mktemp(name))


def test_the_tensors_are_the_packages(preset):
    qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    _, folder = preset
    raw = json.loads((folder / "config.json").read_text())
    reference = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**raw))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes(folder / "model.safetensors") == expected
    codec_raw = json.loads((folder / "speech_tokenizer" / "config.json").read_text())
    encoder = {  # the Mimi encoder is not in the preset; the reference needs one to build
        "hidden_size": 16, "num_filters": 4, "num_residual_layers": 1,
        "upsampling_ratios": [8, 6, 5, 4], "codebook_size": 64, "codebook_dim": 16,
        "num_quantizers": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
        "upsample_groups": 16, "vector_quantization_hidden_dimension": 16,
    }  # fmt: skip
    codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**codec_raw, encoder_config=encoder))
    decoder = {f"decoder.{k}": tuple(v.shape) for k, v in codec.decoder.state_dict().items()}
    assert shapes(folder / "speech_tokenizer" / "model.safetensors") == decoder


def test_a_build_is_the_same_bytes(preset, tmp_path):
    name, folder = preset
    again = build_preset(name, tmp_path / "again")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        twin = again / path.relative_to(folder)
        assert (
            hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(twin.read_bytes()).digest()
        ), path.name


def test_the_built_in_pipeline_speaks(preset):
    from omnistage.entrypoints.omni import Omni
    from omnistage.models.interfaces import SpeechInput
    from omnistage.models.qwen3_tts import FAMILY
    from omnistage.models.tokenizer import Tokenizer

    name, folder = preset
    if name.endswith("customvoice"):
        speech = SpeechInput("hello there", voice="vivian", language="english")
    else:
        speech = SpeechInput("hello there", instructions="a calm deep voice")
    prompt = FAMILY.speech_prompt(str(folder), Tokenizer.from_pretrained(folder).encode, speech)
    with Omni.from_model(str(folder), in_process=True) as omni:
        (out,) = omni.generate(prompt, {"max_tokens": 6, "seed": 1}, ["audio"])
    (audio,) = out.audio
    assert audio.sample_rate == 24000 and len(audio.samples) % 1920 == 0 and audio.samples.any()
