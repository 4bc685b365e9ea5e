"""A code2wav stage serving the tiny Qwen3-Omni checkpoint's causal decoder: the waveform of
the talker's frames is transformers' ``generate``'s, concurrent utterances each sound as
alone, a streamed utterance's chunks join into its whole waveform, sleep (level 1 and 2) and
wake change no sample, and codes that are not whole frames are refused naming the field."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from omnistage.config import StreamChunks
from omnistage.errors import InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.stage.code2wav.engine import Code2WavStageEngine
from omnistage.stage.code2wav.params import Code2WavParams
from omnistage.stage.code2wav.request import Code2WavRequest
from omnistage.stage.code2wav.request_preparer import Code2WavRequestPreparer
from omnistage.stage.code2wav.wire import Code2WavStageInfo, Code2WavStageRequest
from omnistage.stage.request_preparer import RequestOptions
from tests.unit.stage.code2wav.conftest import code2wav_config, run_all, samples_of

GROUPS = 4  # the tiny checkpoint's codebooks (num_quantizers)
PARAMS = Code2WavParams()
CHUNKS = StreamChunks(first_chunk=16, chunk=16)


def frames_of(frames: int, seed: int) -> list[int]:
    """``frames`` frames of codes, flat and frame-major."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (frames * GROUPS,), generator=generator).tolist()


LONG = frames_of(420, 1)  # two of chunked_decode's windows


@pytest.fixture(scope="module")
def engine(tiny_qwen3_omni_folder):
    config = code2wav_config(
        tiny_qwen3_omni_folder,
        stream=True,
        input_from=1,
        input_processor="qwen3_talker_to_code2wav",
        stream_chunks=CHUNKS,
    )
    engine = Code2WavStageEngine(config)
    yield engine
    engine.shutdown()


def one(engine, request_id: str, codes: list[int]) -> torch.Tensor:
    return samples_of(run_all(engine, [Code2WavRequest(request_id, codes, PARAMS)])[request_id])


@pytest.fixture(scope="module")
def long_audio(engine) -> torch.Tensor:
    return one(engine, "long", LONG)


def streamed(engine, request_id: str, codes: list[int], frames_per_piece: int) -> list:
    """The outputs of a streamed request fed ``frames_per_piece`` frames at a time."""
    engine.add_streamed_request(request_id, Code2WavStageRequest(codes=[], params=PARAMS))
    outputs = []
    step = frames_per_piece * GROUPS
    for at in range(0, len(codes), step):
        engine.append_input(request_id, codes[at : at + step], at + step >= len(codes))
        while engine.has_runnable_work():
            outputs.extend(engine.step())
    return outputs


def test_the_waveform_is_generates(engine, tiny_qwen3_omni_folder):
    from tests.qwen3_omni_reference import reference_generate

    ref = reference_generate(
        tiny_qwen3_omni_folder,
        "Hello there, tell me",
        voice="ethan",
        thinker_max_new_tokens=6,
        talker_max_new_tokens=24,
    )
    codes = ref.talker_codes.t().reshape(-1).tolist()  # [G, frames] -> frame-major, flat
    out = run_all(engine, [Code2WavRequest("ref", codes, PARAMS)])["ref"]
    audio = out.media[0]
    assert (audio.voice, audio.sample_rate, audio.codes) == ("ethan", 24000, codes)
    assert np.array_equal(audio.samples.numpy(), ref.waveform)


def test_limits_say_codes_come_in_frames(engine):
    limits = engine.info().limits
    assert (limits.codes_per_frame, limits.codebook_size) == (GROUPS, 64)
    assert limits.voices == ["aiden", "chelsie", "ethan"] and limits.default_voice == "ethan"


def test_concurrent_utterances_each_sound_as_alone(engine, long_audio):
    requests = [Code2WavRequest(f"c{i}", frames_of(5 + 150 * i, i), PARAMS) for i in range(3)]
    requests.append(Code2WavRequest("c-long", LONG, PARAMS))
    alone = {r.request_id: one(engine, f"{r.request_id}-alone", r.codes) for r in requests[:3]}
    alone["c-long"] = long_audio
    together = run_all(engine, requests)
    for request_id, audio in alone.items():
        assert torch.equal(samples_of(together[request_id]), audio), request_id
    assert engine.num_batched_steps == 0  # one utterance per forward


def test_a_streamed_utterance_joins_into_its_whole_waveform(engine, long_audio):
    outputs = streamed(engine, "s", LONG, frames_per_piece=3)
    *partial, last = outputs
    assert len(partial) >= 3 and not any(o.finished for o in partial)  # before the end
    assert last.finished and last.finish_reason == "stop" and last.media[0].codes == LONG
    assert torch.equal(torch.cat([o.media[0].samples for o in outputs]), long_audio)


@pytest.mark.parametrize("level", [1, 2])
def test_the_same_audio_after_sleep_and_wake(engine, long_audio, level):
    assert engine.sleep(level=level).status == "SUCCESS" and engine.is_sleeping()
    assert engine.wake_up().status == "SUCCESS"
    assert torch.equal(one(engine, f"after-{level}", LONG), long_audio)
    outputs = streamed(engine, f"streamed-after-{level}", LONG, frames_per_piece=50)
    assert torch.equal(torch.cat([o.media[0].samples for o in outputs]), long_audio)


def test_codes_that_are_not_whole_frames_are_refused(engine):
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(engine.info()), type=Code2WavStageInfo)
    preparer = Code2WavRequestPreparer(engine.config, info)  # the API process's side
    with pytest.raises(InvalidRequestError, match="whole frames of 4") as caught:
        preparer.prepare({"codes": LONG[:6]}, RequestOptions.of(), Wants())
    assert caught.value.field == "codes"
    with pytest.raises(InvalidRequestError, match="whole frames of 4") as caught:
        engine.add_request(Code2WavRequest("part", LONG[:10], PARAMS))
    assert caught.value.field == "codes"
    with pytest.raises(InvalidRequestError, match="outside the codebook"):
        engine.add_request(Code2WavRequest("big", [64] * GROUPS, PARAMS))
    engine.add_streamed_request("piece", Code2WavStageRequest(codes=[], params=PARAMS))
    with pytest.raises(InvalidRequestError, match="whole frames"):
        engine.append_input("piece", LONG[:6], False)
    engine.abort("piece")
    while engine.has_unfinished_requests():
        engine.step()
