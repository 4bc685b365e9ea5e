"""Qwen3-TTS's decoder streamed (``Qwen3TTSVocoder.streaming_synthesis``: Qwen3-Omni's
``Code2WavStream``) on the tiny checkpoint the package's own classes write: the chunks, joined,
are the whole decode's samples bit for bit (``synthesis``, and the reference package's
``decode``) however the frames arrive, at several chunk sizes and lengths across the 300-frame
windows; the first chunk goes out long before the last frame. The decoder's reach is what its
modules say (its transposed convs trim only their right end: no sample lost), and its
transformer's rows past half a decode depend on the decode's length (the CPU's GEMM splits a
long attention's key sum), so a stream hands out only a decode's first half before its window
is finished — without that rule the samples would differ. A clone's reference frames come
first and their samples are cut as the whole decode cuts them (one sample apart where float
rounding cuts the whole one early and the stream spoke before its end); a request's
``first_chunk`` goes out early, not final, and every later sample is exact. Through a code2wav
stage with the pipeline's processor, a streamed utterance (a clone's too) joins into the whole
one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.memory import Arena
from omnistage.models.qwen3_omni import code2wav_stream
from omnistage.models.qwen3_tts.vocoder import Qwen3TTSVocoder
from tests.unit.models.qwen3_tts.checkpoints import write_codec
from tests.unit.models.qwen3_tts.test_config import write_folder

PARAMS = SimpleNamespace(voice=None)
GROUPS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_tts_stream")
    write_folder(folder, "custom_voice")
    return folder, write_codec(folder)


@pytest.fixture(scope="module")
def vocoder(checkpoint):
    arena = Arena("cpu")
    yield Qwen3TTSVocoder(checkpoint[0], arena)
    arena.close()


def codes_of(frames: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(frames)
    return torch.randint(0, 64, (1, GROUPS, frames), generator=generator)


def flat(codes: torch.Tensor) -> list[int]:
    return codes[0].t().reshape(-1).tolist()


def whole(vocoder, codes: list[int]) -> torch.Tensor:
    synthesis = vocoder.synthesis(codes, PARAMS, 0)
    while not synthesis.is_done:
        vocoder.advance_together([synthesis])
    return synthesis.waveform()


CHUNKS = SimpleNamespace(first_chunk=16, chunk=32)


def whole_clone(vocoder, codes: list[int], context: int) -> torch.Tensor:
    synthesis = vocoder.synthesis(codes, SimpleNamespace(voice=None, context_frames=context), 0)
    while not synthesis.is_done:
        vocoder.advance_together([synthesis])
    return synthesis.waveform()


def streamed(vocoder, codes: list[int], first: int, chunk: int, frames_per_piece: int = 1):
    """The joined chunks of a stream fed ``frames_per_piece`` frames at a time, and the frame
    count received when each chunk went out."""
    stream = vocoder.streaming_synthesis(PARAMS, 0, SimpleNamespace(first_chunk=first, chunk=chunk))
    return feed(vocoder, stream, codes, frames_per_piece)


def feed(vocoder, stream, codes: list[int], frames_per_piece: int, *, joined: bool = True):
    step = frames_per_piece * GROUPS
    pieces, at = [], []
    for start in range(0, len(codes), step):
        stream.add_codes(codes[start : start + step])
        while stream.is_ready:
            vocoder.advance_together([stream])
            pieces.append(stream.take_audio())
            at.append(stream.num_frames)
    stream.end_input()
    while not stream.is_done:
        vocoder.advance_together([stream])
        pieces.append(stream.take_audio())
        at.append(stream.num_frames)
    kept = [(p, n) for p, n in zip(pieces, at, strict=True) if p is not None and p.numel()]
    audio = [p for p, _ in kept]
    return (torch.cat(audio) if joined else audio), [n for _, n in kept]


def test_the_decoders_reach(vocoder):
    """No sample lost (right-trimmed transposed convs read no frame ahead); a decode starting
    f frames in equals the longer one from f x 1920 + context_samples on."""
    reach, per_frame = vocoder.reach, vocoder.samples_per_frame
    assert reach.samples_lost == 0 and reach.settle == code2wav_stream.SETTLE_HALF
    assert [conv.in_channels for conv, _ in reach.front] == [8, 8, 16]  # rvq outs, pre_conv
    hidden = vocoder.hidden_states(codes_of(300))
    full = vocoder.upsample(hidden).reshape(-1)
    assert full.numel() == 300 * per_frame
    start = 30
    assert reach.conv_backends(300 - start) == reach.conv_backends(300)
    late = vocoder.upsample(hidden[:, start:]).reshape(-1)
    offset, clean = start * per_frame, reach.context_samples
    assert torch.equal(late[clean:], full[offset + clean :])
    assert not torch.equal(late[: clean - per_frame], full[offset : offset + clean - per_frame])


@pytest.mark.parametrize(
    ("frames", "first", "chunk", "piece"),
    [(40, 16, 32, 1), (250, 16, 32, 5), (301, 4, 25, 7), (620, 16, 32, 13), (333, 300, 300, 50)],
)
def test_streamed_chunks_join_into_the_whole_decode(vocoder, frames, first, chunk, piece):
    codes = flat(codes_of(frames))
    audio, _ = streamed(vocoder, codes, first, chunk, piece)
    assert audio.numel() == frames * vocoder.samples_per_frame
    assert torch.equal(audio, whole(vocoder, codes))


def test_a_stream_is_the_packages_decode(vocoder, checkpoint):
    codes = codes_of(330)
    audio, at = streamed(vocoder, flat(codes), 16, 32, 3)
    with torch.no_grad():
        ((expected,),) = checkpoint[1].decode(codes.transpose(1, 2), return_dict=False)
    assert torch.equal(audio, expected.reshape(-1).float())
    assert len(at) >= 3 and at[0] < 200  # spoken while the frames came


def test_without_the_half_rule_the_stream_would_differ(vocoder):
    codes = flat(codes_of(290))
    expected = whole(vocoder, codes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vocoder.reach, "settle", code2wav_stream.SETTLE_ALL)
        assert not torch.equal(streamed(vocoder, codes, 16, 16)[0], expected)
    assert torch.equal(streamed(vocoder, codes, 16, 16)[0], expected)


def test_a_chunk_goes_out_once_its_rows_are_final(vocoder):
    """Half of a 16-row-aligned decode whose convolutions run the whole window's kernels."""
    stream = vocoder.streaming_synthesis(PARAMS, 0, SimpleNamespace(first_chunk=16, chunk=32))
    codes = flat(codes_of(300))
    rows = next(r for r in range(16, 300, 16) if vocoder.reach.kernels_agree(r, 300))
    stream.add_codes(codes[: (rows - 1) * GROUPS])
    assert not stream.is_ready
    stream.add_codes(codes[(rows - 1) * GROUPS : rows * GROUPS])
    assert stream.is_ready
    vocoder.advance_together([stream])
    assert stream.take_audio().numel() == rows // 2 * vocoder.samples_per_frame
    assert not stream.is_ready and not stream.is_done


def clone_params(context: int, first_chunk: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(voice=None, context_frames=context, first_chunk=first_chunk)


@pytest.mark.parametrize(
    ("context", "frames", "piece"), [(22, 260, 1), (22, 40, 62), (7, 48, 55), (320, 640, 9)]
)
def test_a_streamed_clone_is_the_whole_clone(vocoder, context, frames, piece):
    """The reference's frames come first and their samples are cut as the whole decode cuts
    them (of 55 frames, ``int(7 / 55 * samples)`` is one short of 7 x 1920: exact here, the
    input ended before the first decode); a context longer than a window skips it."""
    codes = flat(codes_of(context + frames))
    expected = whole_clone(vocoder, codes, context)
    stream = vocoder.streaming_synthesis(clone_params(context), 0, CHUNKS)
    audio, at = feed(vocoder, stream, codes, piece)
    assert torch.equal(audio, expected)
    if context == 7:
        assert audio.numel() == 48 * 1920 + 1
    if piece == 1:
        assert len(at) >= 3 and at[0] < context + frames  # spoken while the frames came


def test_a_clone_streamed_before_its_end_cuts_the_reference_frames_samples(vocoder):
    """Where float rounding cuts the whole clone one sample early (22 of 321 frames), a stream
    that spoke before its last frame cut ``22 x 1920``: the whole's samples but its first."""
    context, codes = 22, flat(codes_of(321))
    expected = whole_clone(vocoder, codes, context)
    assert expected.numel() == 299 * 1920 + 1
    stream = vocoder.streaming_synthesis(clone_params(context), 0, CHUNKS)
    audio, at = feed(vocoder, stream, codes, 3)
    assert at[0] < 321 and torch.equal(audio, expected[1:])


@pytest.mark.parametrize(("context", "first"), [(0, 8), (22, 4)])
def test_an_early_first_chunk_then_the_exact_samples(vocoder, context, first):
    """A request's ``first_chunk``: the first chunk goes out once that many frames follow the
    context, decoded from them alone (not final: it may differ from the whole decode's first
    samples, by little); every later sample is the whole decode's."""
    codes = flat(codes_of(context + 250))
    expected = whole_clone(vocoder, codes, context)
    stream = vocoder.streaming_synthesis(clone_params(context, first), 0, CHUNKS)
    pieces, at = feed(vocoder, stream, codes, 1, joined=False)
    assert at[0] == context + first and pieces[0].numel() == first * 1920
    audio = torch.cat(pieces)
    assert audio.numel() == expected.numel()
    n = pieces[0].numel()
    assert torch.equal(audio[n:], expected[n:])  # exact from the second chunk on
    assert (audio[:n] - expected[:n]).abs().max() < 0.01  # measured: 0.0028, 0.0018
    assert at[1] > at[0]  # the second chunk waits for final rows


# -- through a code2wav stage, with the pipeline's hand-off --------------------------------


@pytest.fixture(scope="module")
def stage(checkpoint):
    from omnistage.config import StreamChunks
    from omnistage.stage.code2wav.engine import Code2WavStageEngine
    from tests.unit.stage.code2wav.conftest import code2wav_config

    config = code2wav_config(
        checkpoint[0],
        stream=True,
        input_from=0,
        input_processor="qwen3_tts.talker_to_code2wav",
        stream_chunks=StreamChunks(first_chunk=16, chunk=32),
    )
    engine = Code2WavStageEngine(config)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("context", [0, 22])
def test_a_streamed_request_joins_into_the_whole_one(stage, vocoder, context):
    """A clone's reference frames come in the talker's first update (the hand-off stream's
    ``feed_update``), before its frames."""
    from omnistage.models.processors import UpstreamResult
    from omnistage.models.qwen3_tts.processors import TalkerFrames
    from omnistage.stage.code2wav.params import Code2WavParams
    from omnistage.stage.code2wav.wire import Code2WavStageRequest

    codes = flat(codes_of(context + 260))
    params = Code2WavParams(context_frames=context)
    stage.add_streamed_request("s", Code2WavStageRequest(codes=[], params=params))
    frames = TalkerFrames(str(stage.config.model))
    outputs = []
    step = 10 * GROUPS
    talker = codes[context * GROUPS :]
    for at in range(0, len(talker), step):
        update = UpstreamResult(token_ids=talker[at : at + step])
        if at == 0:
            update.context_token_ids = codes[: context * GROUPS]
        stage.append_input("s", *frames.feed_update(update, at + step >= len(talker)))
        while stage.has_runnable_work():
            outputs.extend(stage.step())
    *partial, last = outputs
    assert partial and not any(o.finished for o in partial)  # before the end
    assert last.finished and last.finish_reason == "stop" and last.media[0].codes == codes
    joined = torch.cat([o.media[0].samples for o in outputs])
    assert torch.equal(joined, whole_clone(vocoder, codes, context))


def test_an_early_first_chunk_through_the_stage(stage):
    from omnistage.stage.code2wav.params import Code2WavParams
    from omnistage.stage.code2wav.wire import Code2WavStageRequest

    codes = flat(codes_of(40))
    request = Code2WavStageRequest(codes=[], params=Code2WavParams(first_chunk=2))
    stage.add_streamed_request("e", request)
    stage.append_input("e", codes[: 2 * GROUPS], False)
    first = [o for o in stage.step() if o.media]
    assert first and not first[0].finished
    assert first[0].media[0].samples.numel() == 2 * 1920
    stage.append_input("e", codes[2 * GROUPS :], True)
    outputs = []
    while stage.has_unfinished_requests():
        outputs.extend(stage.step())
    assert outputs[-1].finished and outputs[-1].media[0].codes == codes


def test_the_hand_off_streams_whole_frames_up_to_the_codec_end(checkpoint):
    from omnistage.models.qwen3_tts.config import served_config
    from omnistage.models.qwen3_tts.processors import TalkerFrames

    eos = served_config(str(checkpoint[0])).codec.eos
    frames = TalkerFrames(str(checkpoint[0]))
    frame = list(range(GROUPS))
    assert frames.feed(frame + frame[:5], False) == (frame, False)  # whole frames only
    assert frames.feed(frame[5:], False) == (frame, False)
    assert frames.feed([eos], False) == ([], True)  # the codec end ends the input
    empty = TalkerFrames(str(checkpoint[0]))
    with pytest.raises(InvalidRequestError, match="no speech codes"):
        empty.feed([eos], False)


@pytest.mark.parametrize(
    "pipeline",
    ["tiny-qwen3-tts-customvoice", "tiny-qwen3-tts-voicedesign", "tiny-qwen3-tts-base"],
)
def test_the_speech_streams_and_no_stream_hands_the_frames_over_whole(pipeline, checkpoint):
    from omnistage.pipelines import load_pipeline, pipeline_from_model

    def preset(**overrides):
        return load_pipeline(pipeline, build=False, **overrides)

    def model(**overrides):  # serve --model DIR
        return pipeline_from_model(str(checkpoint[0]), **overrides)

    for load in (preset, model):
        talker, code2wav = load().stages
        assert (talker.stream, code2wav.stream) == (False, True)
        assert (code2wav.stream_chunks.first_chunk, code2wav.stream_chunks.chunk) == (16, 32)
        assert not any(s.stream for s in load(stream=False).stages)
