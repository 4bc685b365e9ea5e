"""Qwen3-TTS's speech-tokenizer decoder (``models/qwen3_tts/code2wav.py``) against the official
``qwen-tts`` package: a tiny ``Qwen3TTSTokenizerV2Model`` with random weights (a fresh one
decodes to exact zeros) is saved as a checkpoint's ``speech_tokenizer`` folder, and ours,
loaded from it into an arena, decodes bit for bit as the reference's decoder does: one
``forward`` on short and long codes and a batch, and ``chunked_decode`` past its 300-frame
windows. A checkpoint that lacks a tensor, has one of another shape, or a bad
``decoder_config`` is a ``CheckpointError`` naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.qwen3_tts.code2wav import Qwen3TTSDecoder
from tests.unit.models.qwen3_tts.checkpoints import write_codec
from tests.unit.models.qwen3_tts.test_config import write_folder

SAMPLES_PER_FRAME = 1920


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint folder whose ``speech_tokenizer`` is the tiny reference model's save."""
    folder = tmp_path_factory.mktemp("qwen3_tts")
    write_folder(folder, "custom_voice")  # the checkpoint's own config (its speakers)
    return folder, write_codec(folder)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return checkpoint[1].decoder


@pytest.fixture(scope="module")
def ours(checkpoint):
    arena = Arena("cpu")
    yield Qwen3TTSDecoder.from_folder(checkpoint[0], arena)
    arena.close()


def codes_of(frames: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(
        0, 64, (batch, 16, frames), generator=torch.Generator().manual_seed(frames + batch)
    )


@pytest.mark.parametrize("frames", [1, 7, 40])
def test_forward_is_the_references_bit_for_bit(ours, reference, frames):
    codes = codes_of(frames)
    with torch.no_grad():
        expected = reference(codes)
    got = ours.decode(codes)
    assert got.shape == (1, 1, frames * SAMPLES_PER_FRAME)
    assert expected.abs().amax() > 0  # random weights: not the fresh model's silence
    assert torch.equal(got, expected)


def test_a_batch_is_the_references_batch(ours, reference):
    codes = codes_of(12, batch=2)
    with torch.no_grad():
        expected = reference(codes)
    got = ours.decode(codes)
    assert got.shape == (2, 1, 12 * SAMPLES_PER_FRAME)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("frames", [330, 620])
def test_chunked_decode_is_the_references_across_windows(ours, reference, frames):
    codes = codes_of(frames)
    with torch.no_grad():
        expected = reference.chunked_decode(codes)
    got = ours.chunked_decode(codes)
    assert got.shape == (1, 1, frames * SAMPLES_PER_FRAME)
    assert torch.equal(got, expected)
    # the windows are part of the result: one forward over all frames differs
    assert not torch.equal(got, ours.decode(codes))


def test_the_decoder_takes_only_the_decoder_tensors(ours, checkpoint):
    saved = load_file(checkpoint[0] / "speech_tokenizer" / "model.safetensors")
    decoder = {name for name in saved if name.startswith("decoder.")}
    assert set(ours.weight_targets()) == decoder
    assert any(name.startswith("encoder.") for name in saved)
    assert ours.samples_per_frame == SAMPLES_PER_FRAME and ours.sample_rate == 24000


def edited(checkpoint, tmp_path, *, tensors=None, config=None):
    """A copy of the checkpoint's speech tokenizer with its tensors or config edited."""
    source = checkpoint[0] / "speech_tokenizer"
    target = tmp_path / "speech_tokenizer"
    shutil.copytree(source, target)
    if tensors is not None:
        saved = load_file(source / "model.safetensors")
        tensors(saved)
        save_file(saved, target / "model.safetensors")
    if config is not None:
        raw = json.loads((source / "config.json").read_text())
        config(raw)
        (target / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_a_missing_tensor_is_named(checkpoint, tmp_path):
    name = "decoder.quantizer.rvq_rest.vq.layers.3._codebook.embedding_sum"
    folder = edited(checkpoint, tmp_path, tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name):
        Qwen3TTSDecoder.from_folder(folder, Arena("cpu"))


def test_a_tensor_of_another_shape_is_named(checkpoint, tmp_path):
    name = "decoder.pre_conv.conv.weight"

    def reshape(tensors):
        tensors[name] = torch.zeros(32, 16, 5)

    with pytest.raises(CheckpointError, match=f"shape mismatch for {name}"):
        Qwen3TTSDecoder.from_folder(edited(checkpoint, tmp_path, tensors=reshape), Arena("cpu"))


@pytest.mark.parametrize(
    "key, value",
    [("hidden_size", "wide"), ("upsample_rates", [8, 0]), ("codebook_dim", None)],
)
def test_a_bad_config_key_is_named(checkpoint, tmp_path, key, value):
    def edit(raw):
        if value is None:
            del raw["decoder_config"][key]
        else:
            raw["decoder_config"][key] = value

    folder = edited(checkpoint, tmp_path, config=edit)
    with pytest.raises(CheckpointError, match=f"decoder_config.{key}"):
        Qwen3TTSDecoder.from_folder(folder, Arena("cpu"))


def test_a_folder_without_the_tokenizer_config_is_refused(checkpoint, tmp_path):
    folder = edited(checkpoint, tmp_path, config=lambda raw: raw.update(model_type="mimi"))
    with pytest.raises(CheckpointError, match="model_type"):
        Qwen3TTSDecoder.from_folder(folder, Arena("cpu"))
    with pytest.raises(CheckpointError, match="config.json"):
        Qwen3TTSDecoder.from_folder(tmp_path / "nowhere", Arena("cpu"))


# -- as a code2wav stage runs it --------------------------------------------------------------


@pytest.fixture(scope="module")
def stage(checkpoint):
    from omnistage.stage.code2wav.engine import Code2WavStageEngine
    from tests.unit.stage.code2wav.conftest import code2wav_config

    engine = Code2WavStageEngine(code2wav_config(checkpoint[0]))
    yield engine
    engine.shutdown()


def flat(codes: torch.Tensor) -> list[int]:
    """``[1, Q, T]`` codes as a stage takes them: flat, frame-major."""
    return codes[0].t().reshape(-1).tolist()


def spoken(stage, codes_by_id: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from omnistage.stage.code2wav.params import Code2WavParams
    from omnistage.stage.code2wav.request import Code2WavRequest
    from tests.unit.stage.code2wav.conftest import run_all, samples_of

    requests = [Code2WavRequest(r, flat(c), Code2WavParams()) for r, c in codes_by_id.items()]
    return {r: samples_of(out) for r, out in run_all(stage, requests).items()}


def test_a_code2wav_stage_speaks_the_references_decode(stage, checkpoint):
    """Two utterances at once, one past a window: each the reference model's ``decode``
    (its ``chunked_decode`` of the codes, as ``generate_custom_voice`` speaks them)."""
    codes = {"short": codes_of(9), "long": codes_of(330)}
    got = spoken(stage, codes)
    for request_id, c in codes.items():
        with torch.no_grad():
            ((expected,),) = checkpoint[1].decode(c.transpose(1, 2), return_dict=False)
        assert torch.equal(got[request_id], expected.reshape(-1).float())
    assert stage.info().limits.voices == ["dylan", "vivian"]


@pytest.mark.parametrize("level", [1, 2])
def test_the_stage_speaks_the_same_after_sleeping(stage, level):
    codes = {"before": codes_of(20)}
    before = spoken(stage, codes)["before"]
    stage.sleep(level)
    stage.wake_up()
    stage.resume()
    assert torch.equal(spoken(stage, codes)["before"], before)
