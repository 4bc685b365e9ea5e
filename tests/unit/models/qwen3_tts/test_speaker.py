"""Qwen3-TTS's speaker encoder as omnistage runs it (``models/qwen3_tts/speaker.py``) against the
official ``qwen-tts`` package on a tiny Base checkpoint with random weights: the log-mel the
encoder takes and the x-vector ``extract_speaker_embedding`` returns are the reference's bit for
bit (float32 and bfloat16), and a folder that cannot clone a voice is named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.qwen3_tts.speaker import SpeakerEncoder, mel_bank, speaker_mel
from tests.qwen3_tts_reference import librosa_mel, qwen_tts
from tests.unit.models.qwen3_tts.test_config import talker_config, write_folder

SECONDS = [0.5, 1.3, 3.0]
ENCODER = dict(
    mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8,
    enc_se_channels=8, enc_res2net_scale=8,
)  # fmt: skip


def clip(seconds: float) -> np.ndarray:
    """A seeded mix of a sine and noise at 24 kHz, float32 as the reference reads a file."""
    n = round(seconds * 24000)
    t = np.arange(n) / 24000
    noise = np.random.default_rng(n).standard_normal(n)
    return (0.4 * np.sin(2 * np.pi * 217.0 * t) + 0.1 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Base ``Qwen3TTSForConditionalGeneration`` of the reference's classes, its speaker
    encoder's weights random (seeded), and its folder. Its weights are written with
    safetensors' ``save_model``: the model's ``save_pretrained`` fails on transformers 5.25
    (``_tied_weights_keys`` is a list where transformers now wants a dict)."""
    qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    config = Qwen3TTSConfig(
        talker_config=talker_config(), speaker_encoder_config=ENCODER,
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7", tts_model_type="base",
    )  # fmt: skip
    model = Qwen3TTSForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.speaker_encoder.named_parameters():
            scale = 0.1 if name.endswith("bias") else p[0].numel() ** -0.5
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    folder = tmp_path_factory.mktemp("qwen3_tts_base")
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
    Qwen3TTSTokenizerV2Config().save_pretrained(folder / "speech_tokenizer")
    return folder, model


@pytest.fixture(scope="module")
def encoder(checkpoint):
    arena = Arena("cpu")
    yield SpeakerEncoder.from_folder(checkpoint[0], arena)
    arena.close()


@pytest.fixture
def arena():
    arena = Arena("cpu")
    yield arena
    arena.close()


def reference_mel(model, samples: np.ndarray) -> torch.Tensor:
    """What ``extract_speaker_embedding`` hands its speaker encoder."""
    taken = []
    hook = model.speaker_encoder.register_forward_pre_hook(lambda m, args: taken.append(args[0]))
    try:
        model.extract_speaker_embedding(samples, 24000)
    finally:
        hook.remove()
    return taken[0]


def test_the_mel_bank_is_librosas():
    reference = librosa_mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    assert mel_bank().dtype == torch.float32
    assert np.array_equal(mel_bank().numpy(), reference)


@pytest.mark.parametrize("seconds", SECONDS)
def test_the_mel_is_the_references(checkpoint, seconds):
    samples = clip(seconds)
    reference = reference_mel(checkpoint[1], samples)
    ours = speaker_mel(samples)
    assert ours.shape == reference.shape == (1, len(samples) // 256, 128)
    assert torch.equal(ours, reference)
    assert torch.equal(speaker_mel(torch.from_numpy(samples)), reference)


@pytest.mark.parametrize("seconds", SECONDS)
def test_the_x_vector_is_the_references(checkpoint, encoder, seconds):
    samples = clip(seconds)
    reference = checkpoint[1].extract_speaker_embedding(samples, 24000)
    ours = encoder.embed(samples)
    assert ours.shape == (32,) and ours.dtype == torch.float32
    assert torch.equal(ours, reference)
    assert torch.equal(encoder.embed(torch.from_numpy(samples)), reference)


def test_in_bfloat16_too(checkpoint, arena):
    model = type(checkpoint[1])(checkpoint[1].config).eval()
    model.load_state_dict(checkpoint[1].state_dict())
    model.to(torch.bfloat16)
    ours = SpeakerEncoder.from_folder(checkpoint[0], arena, dtype=torch.bfloat16)
    for seconds in SECONDS:
        samples = clip(seconds)
        reference = model.extract_speaker_embedding(samples, 24000)
        assert reference.dtype == torch.bfloat16
        assert torch.equal(ours.embed(samples), reference)


def test_the_shortest_clip(checkpoint, encoder):
    shortest = encoder.config.min_samples  # 5 frames: the encoder pads 4 on the right
    samples = clip(1.0)
    assert shortest == 1280
    reference = checkpoint[1].extract_speaker_embedding(samples[:shortest], 24000)
    assert torch.equal(encoder.embed(samples[:shortest]), reference)
    with pytest.raises(RuntimeError):  # the reference's reflect padding refuses it
        checkpoint[1].extract_speaker_embedding(samples[: shortest - 1], 24000)
    with pytest.raises(ValueError, match="at least 1280 samples"):
        encoder.embed(samples[: shortest - 1])
    with pytest.raises(ValueError, match="at least 1280 samples"):
        encoder.embed(np.stack([samples, samples]))


def test_the_weights_are_in_the_arena(encoder):
    assert encoder.weight_bytes > 0
    assert all(p.device.type == "cpu" for p in encoder.module.parameters())
    assert set(encoder.weight_targets()) == {
        f"speaker_encoder.{k}" for k in encoder.module.state_dict()
    }


def changed_copy(checkpoint, tmp_path, config=None, tensors=None):
    """The checkpoint copied, with its speaker_encoder_config and tensors changed."""
    folder = tmp_path / "changed"
    shutil.copytree(checkpoint[0], folder)
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        raw["speaker_encoder_config"].update(config)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        save_file(tensors(state), folder / "model.safetensors")
    return folder


def without(name):
    return lambda state: {k: v for k, v in state.items() if k != name}


def reshaped(name):
    return lambda state: {**state, name: state[name][:-1].clone()}


def added(name):
    return lambda state: {**state, name: torch.zeros(3)}


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        (None, without("speaker_encoder.fc.bias"), r"lacks tensors.*speaker_encoder\.fc\.bias"),
        (None, reshaped("speaker_encoder.mfa.conv.weight"), r"shape mismatch for speaker_encoder\.mfa\.conv\.weight"),
        (None, added("speaker_encoder.extra"), r"does not: \['speaker_encoder\.extra'\]"),
        ({"enc_bogus": 1}, None, r"keys the speaker encoder does not: \['enc_bogus'\]"),
        ({"enc_se_channels": "8"}, None, "enc_se_channels must be a positive integer"),
        ({"enc_channels": 16}, None, "enc_channels must be a list of positive integers"),
        ({"enc_dilations": [1, 2, 3]}, None, "enc_dilations must be 5 here"),
        ({"mel_dim": 80}, None, "mel_dim must be 128 here"),
        ({"sample_rate": 16000}, None, "sample_rate must be 24000 here"),
        ({"enc_channels": [16, 16, 16, 16, 32]}, None, r"enc_channels \[16, 16, 16, 16, 32\] make no"),
        ({"enc_dim": 64}, None, "enc_dim 64 is not the talker's hidden_size 32"),
    ],
)  # fmt: skip
def test_a_checkpoint_that_does_not_fit_is_named(
    checkpoint, arena, tmp_path, config, tensors, message
):
    folder = changed_copy(checkpoint, tmp_path, config, tensors)
    with pytest.raises(CheckpointError, match=message):
        SpeakerEncoder.from_folder(folder, arena)


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design"])
def test_only_the_base_variant_clones(arena, tmp_path, variant):
    write_folder(tmp_path, variant)
    with pytest.raises(CheckpointError, match=f"is a {variant} checkpoint: .* Base variant"):
        SpeakerEncoder.from_folder(tmp_path, arena)
