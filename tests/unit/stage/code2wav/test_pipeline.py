"""The code2wav stage's synthesis on the Qwen2.5-Omni family's vocoder (token2wav) as
transformers runs it: the same waveform, read from the checkpoint's own part."""

import json
import shutil

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.loader import CheckpointError, SafetensorsFile, checkpoint_files
from omnistage.models.qwen2_5_omni.code2wav import time_points
from omnistage.models.qwen2_5_omni.token2wav import Token2WavPipeline
from omnistage.stage.code2wav.job import synthesize
from omnistage.stage.code2wav.params import Code2WavParams
from omnistage.stage.code2wav.request import Code2WavRequest
from omnistage.stage.code2wav.worker import Code2WavWorker
from tests.unit.stage.code2wav.conftest import codes_of, reference_waveform


@pytest.fixture(scope="module")
def pipeline(omni_folder):
    arena = Arena("cpu")
    yield Token2WavPipeline(omni_folder, arena)
    arena.close()


CASES = [
    # (codes, voice, seed, num_steps, guidance_scale, sway_coefficient)
    (7, "Chelsie", 11, 4, 0.5, -1.0),  # transformers' defaults but steps
    (23, "Ethan", 12, 3, 0.0, -1.0),  # unguided: one DiT row per call
    (13, "Ethan", 13, 3, 2.0, 0.3),
]


@pytest.mark.parametrize(("length", "voice", "seed", "steps", "guidance", "sway"), CASES)
def test_waveform_equals_transformers_token2wav(
    pipeline, reference_model, omni_folder, length, voice, seed, steps, guidance, sway
):
    codes = codes_of(length, seed)
    params = Code2WavParams(
        voice=voice, seed=seed, num_steps=steps, guidance_scale=guidance, sway_coefficient=sway
    )
    audio = synthesize(pipeline, Code2WavRequest("r", codes, params), seed)
    want = reference_waveform(
        reference_model, omni_folder, codes, voice, seed,
        num_steps=steps, guidance_scale=guidance, sway_coefficient=sway,
    )  # fmt: skip
    samples = audio.samples
    assert samples.dtype == torch.float32 and samples.dim() == 1 and samples.device.type == "cpu"
    assert samples.shape == want.shape
    assert samples.shape[0] == length * pipeline.repeats * 30  # tiny BigVGAN: 5 x 3 x 2
    peak = float(want.abs().max())
    assert peak > 0 and float((samples - want).abs().max()) <= 1e-3 * peak
    assert float(samples.abs().max()) <= 1.0
    assert (audio.voice, audio.seed, audio.sample_rate) == (voice, seed, 24000)


def test_guidance_and_voice_change_the_waveform(pipeline):
    codes = codes_of(9, 1)

    def run(**fields):
        params = Code2WavParams(seed=3, num_steps=3, **fields)
        return synthesize(pipeline, Code2WavRequest("g", codes, params), 3).samples

    guided = run(guidance_scale=0.5)
    assert not torch.equal(guided, run(guidance_scale=0.0))
    assert not torch.equal(guided, run(guidance_scale=0.5, voice="Ethan"))
    assert torch.equal(guided, run(guidance_scale=0.5, voice="Chelsie"))  # the default voice


def test_time_points_sway_as_transformers():
    t = time_points(5, -1.0, torch.device("cpu"))
    # sway -1: 1 - cos(pi t / 2), increasing from 0 to 1
    expected = 1 - torch.cos(torch.pi / 2 * torch.linspace(0, 1, 5))
    assert torch.allclose(t, expected, atol=1e-6) and float(t[0]) == 0.0


def test_the_stage_reads_only_token2wav_tensors(omni_folder, monkeypatch):
    read: list[str] = []
    original_tensor, original_span = SafetensorsFile.tensor, SafetensorsFile.span

    def spy(self, name):  # copied out of the mapping
        read.append(name)
        return original_tensor(self, name)

    def spy_span(self, key, dest, name, shard=None):  # read straight into its destination
        span = original_span(self, key, dest, name, shard)
        if span is not None:
            read.append(key)
        return span

    monkeypatch.setattr(SafetensorsFile, "tensor", spy)
    monkeypatch.setattr(SafetensorsFile, "span", spy_span)
    arena = Arena("cpu")
    try:
        pipeline = Token2WavPipeline(omni_folder, arena)
    finally:
        monkeypatch.undo()
    try:
        names = [
            key
            for file in checkpoint_files(omni_folder)
            for key in SafetensorsFile(file).keys()  # noqa: SIM118 - not a dict
        ]
        own = {n for n in names if n.startswith("token2wav.")}
        others = [n for n in names if not n.startswith("token2wav.")]
        assert any(n.startswith("thinker.") for n in others)
        assert any(n.startswith("talker.") for n in others)
        assert set(read) == own and len(read) == len(own)  # each once, nothing else
        assert all(pipeline.rename(n) is None for n in others)
        assert {pipeline.rename(n) for n in own} == set(pipeline.weight_targets())
        # a Qwen2_5OmniToken2WavModel's own names (no 'token2wav.') are accepted too
        assert pipeline.rename("code2wav_dit_model.proj_out.weight") == (
            "token2wav.code2wav_dit_model.proj_out.weight"
        )
    finally:
        arena.close()


def test_derived_buffers_equal_a_regular_build(pipeline):
    """Non-persistent buffers (rotary inv_freq, anti-aliasing filters) are no checkpoint's:
    after the meta build they must equal what transformers computes."""
    for module in (pipeline.dit, pipeline.vocoder):
        regular = type(module)._from_config(module.config)
        ours, theirs = dict(module.named_buffers()), dict(regular.named_buffers())
        assert ours.keys() == theirs.keys() and ours
        for name, buffer in ours.items():
            assert torch.equal(buffer, theirs[name]), name
    assert all(p.dtype == torch.float32 for p in pipeline.dit.parameters())


def test_limits_and_voices(pipeline):
    assert list(pipeline.voices) == ["Chelsie", "Ethan"] and pipeline.default_voice == "Chelsie"
    assert pipeline.codebook_size == pipeline.dit.config.num_embeds
    assert pipeline.max_codes == pipeline.dit.config.max_position_embeddings // 2
    assert pipeline.sample_rate == 24000
    voice = pipeline.voices["Ethan"]
    assert voice.cond.shape == (1, pipeline.dit.config.enc_emb_dim)
    assert voice.ref_mel.shape[0] == 1 and voice.ref_mel.shape[2] == pipeline.mel_dim


def test_default_voice_without_chelsie_and_bad_voice_files(omni_folder, tmp_path):
    folder = tmp_path / "omni"
    shutil.copytree(omni_folder, folder)
    speakers = torch.load(omni_folder / "spk_dict.pt", weights_only=True)
    torch.save({"Ethan": speakers["Ethan"]}, folder / "spk_dict.pt")
    arena = Arena("cpu")
    try:
        pipeline = Token2WavPipeline(folder, arena, load=False)
        assert list(pipeline.voices) == ["Ethan"] and pipeline.default_voice == "Ethan"
    finally:
        arena.close()
    bad = dict(speakers["Ethan"], cond=torch.zeros(1, 3))
    torch.save({"Ethan": bad}, folder / "spk_dict.pt")
    with pytest.raises(CheckpointError, match="Ethan"), Arena("cpu") as arena:
        Token2WavPipeline(folder, arena, load=False)
    (folder / "spk_dict.pt").unlink()
    with pytest.raises(CheckpointError, match="spk_dict.pt"), Arena("cpu") as arena:
        Token2WavPipeline(folder, arena, load=False)


def test_a_folder_without_token2wav_is_refused(omni_folder, tmp_path):
    with pytest.raises(CheckpointError, match="not a Qwen2.5-Omni"), Arena("cpu") as arena:
        Token2WavPipeline(tmp_path, arena)
    folder = tmp_path / "thinker-only"
    folder.mkdir()
    raw = json.loads((omni_folder / "config.json").read_text())
    raw.pop("token2wav_config")
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no token2wav_config"), Arena("cpu") as arena:
        Token2WavPipeline(folder, arena)
    config = StageConfig(stage_id=0, kind="code2wav", model=str(omni_folder), model_stage="talker")
    with pytest.raises(ValueError, match="model_stage"):
        Code2WavWorker(config)
