"""Speech chunk by chunk (``models/qwen2_5_omni/streaming.py`` in the code2wav stage): with
contexts that cover the ODE's and the vocoder's reach the streamed waveform is the whole
utterance's up to float rounding; the samples never depend on how the codes arrive; a
streamed request waits for its codes, hands out each chunk when it is done, and fails on a
bad code without touching the others."""

from types import SimpleNamespace

import pytest
import torch

from omnistage.config import StreamChunks
from omnistage.memory import Arena
from omnistage.models.qwen2_5_omni.code2wav import synthesize
from omnistage.models.qwen2_5_omni.streaming import dit_reach_codes, vocoder_context_frames
from omnistage.models.qwen2_5_omni.token2wav import Token2WavPipeline
from omnistage.stage.code2wav.engine import Code2WavStageEngine
from omnistage.stage.code2wav.params import Code2WavParams
from omnistage.stage.code2wav.wire import Code2WavStageRequest
from tests.unit.stage.code2wav.conftest import code2wav_config, codes_of

STEPS = 2  # one RK4 step: four DiT calls, a reach a short utterance can cover
PARAMS = Code2WavParams(seed=5, num_steps=STEPS)
CODES = codes_of(60, 3)


@pytest.fixture(scope="module")
def pipeline(omni_folder):
    arena = Arena("cpu")
    yield Token2WavPipeline(omni_folder, arena)
    arena.close()


def covering(pipeline) -> StreamChunks:
    behind, ahead = dit_reach_codes(pipeline.dit.config, STEPS)
    vocoder = -(-vocoder_context_frames(pipeline.vocoder.config) // pipeline.repeats)
    return StreamChunks(first_chunk=8, chunk=16, left_context=behind, right_context=ahead + vocoder)


def streamed(pipeline, chunks, codes=CODES, piece=1) -> tuple[torch.Tensor, int]:
    stream = pipeline.streaming_synthesis(PARAMS, 5, chunks)
    audio = []
    for start in range(0, len(codes), piece):
        stream.add_codes(codes[start : start + piece])
        while stream.is_ready:
            stream.advance()
        audio.append(stream.take_audio())
    stream.end_input()
    while not stream.is_done:
        stream.advance()
    audio.append(stream.take_audio())
    return torch.cat([a for a in audio if a is not None]), stream.num_windows


def test_with_covering_contexts_the_stream_is_the_whole_utterance(pipeline):
    whole = synthesize(pipeline, CODES, PARAMS, 5)
    chunks = covering(pipeline)
    assert chunks.left_context + chunks.first_chunk < len(CODES)  # windows really cut
    audio, windows = streamed(pipeline, chunks)
    assert windows == 5 and audio.shape == whole.shape
    assert float((audio - whole).abs().max()) <= 1e-5 * float(whole.abs().max())


def test_the_samples_do_not_depend_on_how_the_codes_arrive(pipeline):
    chunks = StreamChunks(first_chunk=4, chunk=12, left_context=8, right_context=4)
    one_by_one, _ = streamed(pipeline, chunks, piece=1)
    all_at_once, _ = streamed(pipeline, chunks, piece=len(CODES))
    assert torch.equal(one_by_one, all_at_once)


def test_a_stream_waits_for_a_chunk_and_its_right_context(pipeline):
    chunks = SimpleNamespace(first_chunk=8, chunk=16, left_context=8, right_context=4)
    stream = pipeline.streaming_synthesis(PARAMS, 5, chunks)
    stream.add_codes(CODES[:11])
    assert not stream.is_ready  # 8 codes + 4 after them
    stream.add_codes(CODES[11:12])
    assert stream.is_ready
    while stream.is_ready:
        stream.advance()
    assert stream.take_audio().numel() == 8 * pipeline.repeats * stream.hop
    assert not stream.is_done


@pytest.fixture(scope="module")
def engine(omni_folder):
    chunks = StreamChunks(first_chunk=8, chunk=16, left_context=8, right_context=4)
    engine = Code2WavStageEngine(code2wav_config(omni_folder, stream=True, input_from=1,
                                                 input_processor="talker_to_code2wav",
                                                 stream_chunks=chunks))  # fmt: skip
    yield engine
    engine.shutdown()


def drain(engine) -> list:
    outputs = []
    while engine.has_runnable_work():
        outputs.extend(engine.step())
    return outputs


def test_a_streamed_request_hands_out_chunks_as_they_are_done(engine):
    engine.add_streamed_request("s", Code2WavStageRequest(codes=[], params=PARAMS))
    drain(engine)
    assert engine.has_unfinished_requests() and not engine.has_runnable_work()  # waits
    pieces = []
    for start in range(0, len(CODES), 10):
        engine.append_input("s", CODES[start : start + 10], start + 10 >= len(CODES))
        pieces.extend(drain(engine))
    *partial, last = pieces
    assert partial and not any(o.finished for o in partial)
    assert last.finished and last.finish_reason == "stop" and last.media[0].codes == CODES
    audio = torch.cat([o.media[0].samples for o in pieces])
    expected, _ = streamed(engine.vocoder, engine.config.stream_chunks)
    assert torch.equal(audio, expected)


def test_an_early_first_chunk_is_refused_naming_the_field(engine):
    """Qwen2.5-Omni's stream sends its chunks as ``stream_chunks`` says, none early."""
    from omnistage.errors import InvalidRequestError

    params = Code2WavParams(seed=5, num_steps=STEPS, first_chunk=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_streamed_request("early", Code2WavStageRequest(codes=[], params=params))
    assert info.value.field == "audio_params.first_chunk"
    assert not engine.has_unfinished_requests()


def test_a_bad_code_fails_only_its_request(engine):
    engine.add_streamed_request("bad", Code2WavStageRequest(codes=[], params=PARAMS))
    engine.add_streamed_request("good", Code2WavStageRequest(codes=[], params=PARAMS))
    engine.append_input("good", CODES[:20], True)
    try:
        engine.append_input("bad", [10**6], False)
    except Exception as exc:  # the stage core fails the request with it
        engine.fail_request("bad", exc)
    outputs = {o.request_id: o for o in drain(engine) if o.finished}
    assert outputs["bad"].finish_reason == "error" and "codes" in str(outputs["bad"].error)
    assert outputs["good"].finish_reason == "stop"


def test_an_aborted_stream_stops_and_later_input_is_dropped(engine):
    engine.add_streamed_request("gone", Code2WavStageRequest(codes=[], params=PARAMS))
    engine.append_input("gone", CODES[:12], False)
    engine.step()
    steps = engine.num_steps
    engine.abort("gone")
    engine.append_input("gone", CODES[12:30], True)  # the stage before still speaking
    outputs = drain(engine)
    assert [o.finish_reason for o in outputs if o.finished] == ["abort"]
    assert engine.num_steps <= steps + 1 and not engine.has_unfinished_requests()


def test_streams_share_forwards_and_each_gets_its_audio_alone(engine):
    def run(request_ids: list[str]) -> dict[str, torch.Tensor]:
        for request_id in request_ids:
            engine.add_streamed_request(request_id, Code2WavStageRequest(codes=[], params=PARAMS))
        audio: dict[str, list[torch.Tensor]] = {r: [] for r in request_ids}
        for start in range(0, len(CODES), 6):
            for request_id in request_ids:
                engine.append_input(request_id, CODES[start : start + 6], start + 6 >= len(CODES))
            for out in drain(engine):
                audio[out.request_id].append(out.media[0].samples)
        return {r: torch.cat(pieces) for r, pieces in audio.items()}

    alone = run(["alone"])["alone"]
    batched = engine.num_batched_steps
    together = run([f"t{i}" for i in range(4)])
    assert engine.num_batched_steps > batched
    assert all(torch.equal(audio, alone) for audio in together.values())
