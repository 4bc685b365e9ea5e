"""Qwen3-Omni's code2wav as the code2wav stage runs it (``models/qwen3_omni/code2wav.py``) on
the tiny checkpoint, against transformers' own ``Qwen3OmniMoeCode2Wav`` filled by the
safetensors library: the whole decode is generate's ``chunked_decode(codes, 300, 25)`` bit for
bit (also past 300 frames, where that differs from one ``forward``); the decoder's reach
(the samples a decode falls short, the samples its zero padding reaches) is what the config
says; streamed chunks, joined, are the whole decode however the frames arrive — and without
the stream's 16-row steps or its matching of conv kernels they would not be; padding after the
end or a second utterance in the batch changes an utterance's last bits, so none is batched."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from omnistage.memory import Arena
from omnistage.models.qwen3_omni import code2wav_stream
from omnistage.models.qwen3_omni.code2wav import CHUNK_FRAMES, Code2WavVocoder, windows
from tests.unit.models.qwen3_omni.thinker_helpers import tiny_folder

PARAMS = SimpleNamespace(voice=None)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def vocoder():
    arena = Arena("cpu")
    yield Code2WavVocoder(tiny_folder(), arena)
    arena.close()


@pytest.fixture(scope="module")
def reference():
    """transformers' ``Qwen3OmniMoeCode2Wav`` from the checkpoint's ``code2wav.*`` tensors."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    folder = tiny_folder()
    raw = json.loads((folder / "config.json").read_text())
    model = Qwen3OmniMoeCode2Wav._from_config(
        Qwen3OmniMoeCode2WavConfig(**raw["code2wav_config"]), attn_implementation="sdpa"
    )
    state = {
        name.removeprefix("code2wav."): tensor
        for file in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
        if name.startswith("code2wav.")
    }
    model.load_state_dict(state, strict=True)
    return model.eval()


def codes_of(frames: int, groups: int = 4) -> torch.Tensor:
    """``[1, groups, frames]`` codes, as generate hands them to code2wav."""
    return torch.randint(
        0, 64, (1, groups, frames), generator=torch.Generator().manual_seed(frames)
    )


def flat(codes: torch.Tensor) -> list[int]:
    """Frame-major and flat, as the talker stage sends them."""
    return codes[0].t().reshape(-1).tolist()


def whole(vocoder, codes: list[int]) -> torch.Tensor:
    synthesis = vocoder.synthesis(codes, PARAMS, 0)
    while not synthesis.is_done:
        vocoder.advance_together([synthesis])
    return synthesis.waveform()


def streamed(vocoder, codes: list[int], first: int, chunk: int, frames_per_piece: int = 1):
    """The joined chunks of a stream fed ``frames_per_piece`` frames at a time, and the
    chunks' count."""
    stream = vocoder.streaming_synthesis(PARAMS, 0, SimpleNamespace(first_chunk=first, chunk=chunk))
    step = frames_per_piece * vocoder.codes_per_frame
    pieces = []
    for at in range(0, len(codes), step):
        stream.add_codes(codes[at : at + step])
        while stream.is_ready:
            vocoder.advance_together([stream])
            pieces.append(stream.take_audio())
    stream.end_input()
    while not stream.is_done:
        vocoder.advance_together([stream])
        pieces.append(stream.take_audio())
    return torch.cat([p for p in pieces if p is not None]), len(pieces)


@pytest.mark.parametrize("frames", [1, 17, 300, 301, 326, 777])
def test_the_whole_decode_is_generates_chunked_decode(vocoder, reference, frames):
    codes = codes_of(frames)
    with torch.no_grad():
        expected = reference.chunked_decode(codes, chunk_size=300, left_context_size=25)
    audio = whole(vocoder, flat(codes))
    assert audio.dtype == torch.float32 and audio.dim() == 1
    assert torch.equal(audio, expected.float().reshape(-1))
    lost = len(windows(frames)) * vocoder.reach.samples_lost
    assert audio.numel() == frames * vocoder.samples_per_frame - lost


def test_past_300_frames_chunked_decode_is_not_one_forward(reference, vocoder):
    codes = codes_of(2 * CHUNK_FRAMES)
    with torch.no_grad():
        chunked = reference.chunked_decode(codes, chunk_size=300, left_context_size=25)[0, 0]
        one = reference(codes)[0, 0]
    assert one.numel() - chunked.numel() == vocoder.reach.samples_lost  # lost once more
    cut = CHUNK_FRAMES * vocoder.samples_per_frame - vocoder.reach.samples_lost
    assert torch.allclose(chunked[:cut], one[:cut], atol=1e-5)  # the first window: as one
    assert not torch.allclose(chunked[cut:], one[cut : chunked.numel()], atol=1e-2)


def test_the_decoders_reach(vocoder):
    """``samples_lost``: a decode of n frames is n x samples_per_frame less that; a decode
    starting f frames in equals the longer one from f x samples_per_frame + context_samples on,
    and not from a frame earlier."""
    reach, per_frame = vocoder.reach, vocoder.samples_per_frame
    hidden = vocoder.hidden_states(codes_of(290).to(vocoder.device))
    full = vocoder.upsample(hidden).reshape(-1)
    assert full.numel() == 290 * per_frame - reach.samples_lost
    start = 30  # the convolutions run the same kernels on frames 30.. as on all 290
    assert reach.conv_backends(290 - start) == reach.conv_backends(290)
    late = vocoder.upsample(hidden[:, start:]).reshape(-1)
    offset, clean = start * per_frame, reach.context_samples
    assert torch.equal(late[clean:], full[offset + clean :])
    assert not torch.equal(
        late[clean - per_frame : clean], full[offset + clean - per_frame :][:per_frame]
    )


@pytest.mark.parametrize(
    ("frames", "first", "chunk", "piece"),
    [(40, 16, 32, 1), (299, 16, 16, 1), (301, 4, 25, 7), (650, 16, 32, 13), (777, 300, 300, 50)],
)
def test_streamed_chunks_join_into_the_whole_decode(vocoder, frames, first, chunk, piece):
    codes = flat(codes_of(frames))
    audio, chunks = streamed(vocoder, codes, first, chunk, piece)
    assert torch.equal(audio, whole(vocoder, codes))
    if chunk >= CHUNK_FRAMES:  # a window per chunk: each decoded as the whole decode does
        assert chunks == len(windows(frames))
    elif frames > CHUNK_FRAMES:
        assert chunks > len(windows(frames))  # spoken before each window was in


def test_without_16_row_steps_or_the_same_conv_kernels_the_stream_would_differ(
    vocoder, monkeypatch
):
    codes = flat(codes_of(420))
    expected = whole(vocoder, codes)
    with monkeypatch.context() as patch:
        patch.setattr(code2wav_stream, "ROW_ALIGN", 1)
        assert not torch.equal(streamed(vocoder, codes, 1, 5)[0], expected)
    with monkeypatch.context() as patch:
        patch.setattr(vocoder.reach, "conv_backends", lambda frames: ())
        assert not torch.equal(streamed(vocoder, codes, 16, 16)[0], expected)
    assert torch.equal(streamed(vocoder, codes, 16, 16)[0], expected)


def test_a_stream_waits_for_its_chunk_and_takes_whole_frames_only(vocoder):
    stream = vocoder.streaming_synthesis(PARAMS, 0, SimpleNamespace(first_chunk=16, chunk=16))
    codes = flat(codes_of(240))
    stream.add_codes(codes[: 239 * 4])
    assert stream.is_ready  # 224 frames, a multiple of 16 whose kernels are the window's
    vocoder.advance_together([stream])
    assert (
        stream.take_audio().numel() == 224 * vocoder.samples_per_frame - vocoder.reach.samples_lost
    )
    assert not stream.is_ready and not stream.is_done  # 15 frames more: not a step of 16
    with pytest.raises(ValueError, match="whole frames"):
        stream.add_codes(codes[239 * 4 : 239 * 4 + 3])
    stream.add_codes(codes[239 * 4 :])
    assert stream.is_ready
    stream.end_input()
    with pytest.raises(ValueError, match="after the end"):
        stream.add_codes(codes[:4])


def test_padding_after_the_end_or_a_batch_changes_the_last_bits(reference, vocoder):
    """Why utterances are decoded one at a time: causal, so the same in exact arithmetic, but
    not bit for bit."""
    codes, other = codes_of(100), codes_of(300)
    keep = 100 * vocoder.samples_per_frame - vocoder.reach.samples_lost
    padded = torch.cat([codes, torch.zeros(1, 4, 200, dtype=torch.long)], dim=-1)
    with torch.no_grad():
        alone = reference(codes)[0, 0]
        longer = reference(padded)[0, 0, :keep]
        batched = reference(torch.cat([padded, other]))[0, 0, :keep]
    for audio in (longer, batched):
        assert torch.allclose(audio, alone, atol=1e-5) and not torch.equal(audio, alone)
