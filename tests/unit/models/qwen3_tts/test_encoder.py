"""The speech tokenizer's encoder as omnistage runs it (``models/qwen3_tts/codec_encoder.py``)
against the official ``qwen-tts`` package: a clip's codes (``[frames, 16]``) equal its
tokenizer's ``encode`` bit for bit, clips of a sample to several seconds, from a checkpoint the
package saved (transformers 5's nested names) and from the tiny Base preset (the published flat
names, which the package on transformers 5 leaves unread: the test renames them for it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.memory import Arena
from omnistage.models.qwen3_tts.codec_encoder import CodecEncoder, frames_of, rename
from tests.qwen3_tts_reference import qwen_tts
from tests.unit.models.qwen3_tts.checkpoints import module_name, write_base

LENGTHS = [1, 500, 1920, 1921, 24000 * 2 + 100, 24000 * 5 + 7]


def clip(n: int) -> np.ndarray:
    return (np.random.default_rng(n).standard_normal(n) * 0.3).astype(np.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Base checkpoint the package wrote, its tokenizer, and our encoder of it."""
    folder = tmp_path_factory.mktemp("qwen3_tts_base")
    model = write_base(folder)
    arena = Arena("cpu")
    yield model.model.speech_tokenizer, CodecEncoder(folder, arena)
    arena.close()


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """The tiny Base preset, the package's tokenizer loaded from it (the flat names renamed
    to the nested ones it reads), and our encoder of it."""
    from safetensors.torch import load_file

    from omnistage.models.qwen3_tts.tiny import build

    folder = build(tmp_path_factory.mktemp("tiny_base"), "base")
    qwen_tts()
    from qwen_tts import Qwen3TTSTokenizer

    tokenizer = Qwen3TTSTokenizer.from_pretrained(str(folder / "speech_tokenizer"))
    flat = load_file(str(folder / "speech_tokenizer" / "model.safetensors"))
    modules = {module_name(k): v for k, v in flat.items() if k.startswith("encoder.")}
    result = tokenizer.model.load_state_dict(modules, strict=False)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if k.startswith("encoder.")]
    arena = Arena("cpu")
    yield tokenizer, CodecEncoder(folder, arena)
    arena.close()


def nested_name(flat: str) -> str:
    """A published name as transformers 5's nested ``MimiModel`` under ``encoder.`` has it."""
    for before, after in (
        ("encoder.encoder.", "encoder.encoder.encoder."),
        ("encoder.encoder_transformer.", "encoder.encoder.encoder_transformer."),
        ("encoder.downsample.", "encoder.encoder.downsample."),
    ):
        if flat.startswith(before):
            return after + flat[len(before) :]
    return flat


@pytest.mark.parametrize("n", LENGTHS)
def test_the_codes_are_the_references(saved, n):
    reference, ours = saved
    expected = reference.encode(clip(n), sr=24000).audio_codes[0]
    codes = ours.encode(clip(n))
    assert codes.shape == (frames_of(n, 1920), 16) == tuple(expected.shape)
    assert torch.equal(codes, expected)
    assert torch.equal(ours.encode(torch.from_numpy(clip(n))), expected)


@pytest.mark.parametrize("n", [1921, 24000 * 3])
def test_the_presets_codes_are_the_references(preset, n):
    reference, ours = preset
    codes = ours.encode(clip(n))
    assert torch.equal(codes, reference.encode(clip(n), sr=24000).audio_codes[0])
    assert len(set(codes.reshape(-1).tolist())) > 8  # random codebooks: codes vary


def test_both_layouts_name_the_same_tensors(preset):
    ours = preset[1]
    published = sorted(ours.weight_targets())
    assert all(rename(nested_name(k)) == k for k in published)
    assert "encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight" in published
    assert rename("decoder.pre_conv.conv.weight") is None
