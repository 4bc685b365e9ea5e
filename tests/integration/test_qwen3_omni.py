"""Qwen3-Omni served as thinker → talker → code2wav (``Omni.from_model`` on the tiny-qwen3-omni
preset, stages in process) against transformers' own
``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy thinker and talker, the thinker
stopping at ``<|im_end|>``; tests/qwen3_omni_reference.py) for a text, an audio, an image and
an audio + image prompt (and two video prompts: ``test_video_prompts_match_transformers``):
the thinker's ids, every codebook of the talker's codes (as the code2wav stage reports them:
frame-major and flat, ``audio.codes``) and the waveform are the same — alone, two requests at
once, after every stage slept (level 1, then level 2) and woke, and with the thinker split
over two tensor-parallel ranks. Speech streamed as the stages speak (the pipeline's ``stream:
true``, through ``AsyncOmni``, whose updates carry each piece) joins into the same samples,
bit for bit, as speech synthesised in one piece (``stream=False``), also for a reply long
enough to be cut into pieces (with one torch thread; with two, oneDNN splits a long
convolution's work by its length and the samples agree within 2e-5).

For the audio + image prompt transformers 5.24's talker raises (it reads an audio window its
config lacks); the reference gives it the original code's window (see its docstring), and
omnistage's talker positions equal what it then computes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch

from omnistage.engine.async_omni import AsyncOmni
from omnistage.entrypoints.omni import Omni
from tests.qwen3_omni_media import media_items, messages, options, processor_outputs
from tests.qwen3_omni_reference import reference_generate

VOICE = "chelsie"
THINKER_TOKENS, TALKER_TOKENS = 8, 16  # 15 frames (the last code sampled has no frame)
# A reply the tiny code2wav streams in pieces: at its sizes the CPU convolutions of a decode
# under 161 frames run other kernels than the 300-frame window's, so no chunk goes out earlier
LONG_TALKER_TOKENS = 240
GREEDY = {"temperature": 0.0, "max_tokens": THINKER_TOKENS}
TEXT = "Hello there"
# audio: 2.5 s (33 placeholders); image: 10 x 16 patches; audio_image: 1.3 s and 60 x 90 px
CASES = ("text", "audio", "image", "audio_image")
# transformers' talker generate gets embeddings only: its penalty warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")


def prompt_of(case: str) -> dict:
    """The case as ``Omni.generate`` takes it: chat messages, media in prompt order, options."""
    if case == "text":
        return {"messages": [{"role": "user", "content": TEXT}]}
    return {
        "messages": messages(case),
        "multi_modal_data": media_items(case),
        "mm_processor_kwargs": options(case),
    }


def speech_params(talker_tokens: int = TALKER_TOKENS) -> dict:
    return {
        "talker_params": {"temperature": 0.0, "max_tokens": talker_tokens},
        "audio_params": {"voice": VOICE},
    }


@pytest.fixture(scope="module")
def folder(tiny_qwen3_omni_folder):
    return str(tiny_qwen3_omni_folder)


@pytest.fixture(scope="module")
def whole(folder):
    """Speech synthesised in one piece, as transformers speaks it."""
    omni = Omni.from_model(folder, in_process=True, enable_sleep_mode=True, stream=False)
    yield omni
    omni.shutdown()


@pytest_asyncio.fixture(scope="module")
async def streamed(folder):
    """The pipeline as it comes: code2wav speaks the frames as the talker makes them."""
    engine = AsyncOmni.from_model(folder, in_process=True)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(folder):
    """Per case: transformers' generate (computed once)."""
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            outputs = None if case == "text" else processor_outputs(folder, case)
            if outputs and outputs.get("use_audio_in_video"):
                outputs["talker_use_audio_in_video"] = True  # see the reference's docstring
            cache[case] = reference_generate(
                folder,
                TEXT,
                voice=VOICE,
                thinker_max_new_tokens=THINKER_TOKENS,
                talker_max_new_tokens=TALKER_TOKENS,
                processor_outputs=outputs,
            )
        return cache[case]

    return get


def speak(omni: Omni, cases: list[str], talker_tokens: int = TALKER_TOKENS):
    return omni.generate(
        [prompt_of(c) for c in cases], GREEDY, ["text", "audio"], **speech_params(talker_tokens)
    )


def assert_same(out, ref) -> None:
    assert out.token_ids == ref.thinker_ids
    (audio,) = out.audio
    assert audio.codes == ref.talker_codes.T.reshape(-1).tolist()  # frame-major, every codebook
    assert audio.sample_rate == 24000 and audio.samples.dtype == np.float32
    assert audio.voice == VOICE
    assert np.array_equal(audio.samples, ref.waveform)


@pytest.mark.parametrize("case", CASES)
def test_ids_codes_and_waveform_match_transformers(whole, reference, case):
    (out,) = speak(whole, [case])
    assert_same(out, reference(case))
    assert len(out.audio[0].codes) == 4 * (TALKER_TOKENS - 1)  # 4 code groups per frame


def test_video_prompts_match_transformers(whole, reference):
    """A video (3 temporal patches at fps 1: 26 position ids apart) and a video with its
    audio track interleaved (``use_audio_in_video``, beside another audio), together: ids,
    codes and waveform as transformers' (the second with ``use_audio_in_video`` handed to the
    talker too, which its generate omits: the reference's docstring)."""
    video, video_audio = speak(whole, ["video", "video_audio"])
    assert_same(video, reference("video"))
    assert_same(video_audio, reference("video_audio"))


def test_two_requests_at_once_give_what_each_gives_alone(whole, reference):
    audio, image = speak(whole, ["audio", "image"])
    assert_same(audio, reference("audio"))
    assert_same(image, reference("image"))


@pytest.mark.parametrize("level", [1, 2])
def test_after_every_stage_slept_and_woke(whole, reference, level):
    acks = whole.sleep([0, 1, 2], level=level)
    assert [a["status"] for a in acks] == ["SUCCESS"] * 3
    assert {s["state"] for s in whole.stage_status()} == {"asleep"}
    whole.wake_up([0, 1, 2])  # Omni's wake serves again, as the server's (no resume call)
    assert not any(s["paused"] for s in whole.stage_status())
    (out,) = speak(whole, ["image"])
    assert_same(out, reference("image"))


async def stream_speech(
    engine: AsyncOmni, case: str, talker_tokens: int = TALKER_TOKENS
) -> tuple[list[np.ndarray], object]:
    """A streamed reply's audio pieces, in order, and the whole its last update carries."""
    pieces, final = [], None
    params = speech_params(talker_tokens)
    async for out in engine.generate(prompt_of(case), GREEDY, ["text", "audio"], **params):
        pieces += [a.samples for a in out.audio_delta]
        if out.audio:
            final = out.audio[0]
    return pieces, final


async def test_streamed_speech_is_the_whole_synthesis_bit_for_bit(streamed, reference):
    runs = await asyncio.gather(*(stream_speech(streamed, c) for c in CASES))
    for case, (pieces, final) in zip(CASES, runs, strict=True):
        ref = reference(case)  # equal to the whole synthesis (the tests above)
        assert pieces and np.array_equal(np.concatenate(pieces), ref.waveform)
        assert final.codes == ref.talker_codes.T.reshape(-1).tolist()
        assert np.array_equal(final.samples, ref.waveform)


@pytest.mark.parametrize("threads", [1, 2])
async def test_a_long_streamed_reply_joins_into_the_whole_synthesis(folder, threads):
    """Pieces cut inside code2wav's first 300-frame window: bit for bit with one torch
    thread; with two, within 2e-5 (oneDNN splits a long convolution's work by its length).

    Pipelines of their own, made after the thread count is set: a thread takes torch's count
    when it first computes and keeps it (OpenMP's is per thread), so the module's pipelines,
    whose stage threads computed before, would keep whatever count they started with."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    streamed = AsyncOmni.from_model(folder, in_process=True)
    whole = Omni.from_model(folder, in_process=True, stream=False)
    try:
        pieces, final = await stream_speech(streamed, "text", LONG_TALKER_TOKENS)
        (out,) = await asyncio.to_thread(speak, whole, ["text"], LONG_TALKER_TOKENS)
    finally:
        streamed.shutdown()
        whole.shutdown()
        torch.set_num_threads(previous)
    (audio,) = out.audio
    assert len(audio.codes) == 4 * (LONG_TALKER_TOKENS - 1) and final.codes == audio.codes
    assert len(pieces) > 1
    joined = np.concatenate(pieces)
    if threads == 1:
        assert np.array_equal(joined, audio.samples)
        assert np.array_equal(final.samples, audio.samples)
    else:
        np.testing.assert_allclose(joined, audio.samples, rtol=0, atol=2e-5)
        np.testing.assert_allclose(final.samples, audio.samples, rtol=0, atol=2e-5)


def test_the_thinker_split_over_two_ranks_speaks_the_same(folder, reference):
    """The thinker at tensor_parallel_size=2 (two rank processes; experts split over their
    features, DeepStack rows on each rank) and its streamed hand-off: the same ids, codes
    and waveform as transformers for the image prompt."""
    from omnistage.pipelines import pipeline_from_model

    config = pipeline_from_model(folder)
    stages = [
        s.model_copy(update={"tensor_parallel_size": 2}) if s.stage_id == 0 else s
        for s in config.stages
    ]
    omni = Omni.from_config(config.model_copy(update={"stages": stages}), in_process=True)
    try:
        (out,) = speak(omni, ["image"])
    finally:
        omni.shutdown()
    assert_same(out, reference("image"))
