"""A real ``omnistage serve --model DIR`` on the tiny-qwen3-omni checkpoint (thinker → talker →
code2wav, code2wav streamed as the pipeline says): the official ``openai`` client gets speech
as OpenAI defines it — ``message.audio``, a 24 kHz WAV whose samples are transformers'
waveform (``Qwen3OmniMoeForConditionalGeneration.generate``, greedy, tests/qwen3_omni_reference.py)
for each voice the checkpoint names; streamed as ``delta.audio`` pieces that join into the
same samples. (Audio and image prompts are compared with transformers in
tests/integration/test_qwen3_omni.py; so are video prompts, which HTTP takes here as an MP4.)
An unknown voice, an undecodable video and a video rate whose positions would be fractional
are 400s naming the field."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import openai
import pytest

from omnistage.stage.media import OmniAudio
from tests.e2e.server import running_server
from tests.e2e.speech_omni import *  # noqa: F403 - the speech route's tests, on this server
from tests.qwen3_omni_reference import reference_generate

MODEL = "tiny-qwen3-omni"  # the checkpoint folder's name: the served model's
THINKER_TOKENS, TALKER_TOKENS = 6, 16
MESSAGES = [{"role": "user", "content": "Hello there"}]
EXTRA = {"talker_params": {"temperature": 0, "max_tokens": TALKER_TOKENS}}
VOICES = ["aiden", "chelsie", "ethan"]  # talker_config.speaker_id's names
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")


@pytest.fixture(scope="module")
def preset() -> str:
    """The built-in pipeline whose folder this module's server serves (``speech_omni``)."""
    return "tiny-qwen3-omni"


@pytest.fixture(scope="module")
def folder(tiny_qwen3_omni_folder) -> str:
    return str(tiny_qwen3_omni_folder)


@pytest.fixture(scope="module")
def server(folder):
    with running_server("--model", folder) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def speak(client, voice: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"}, temperature=0, max_tokens=THINKER_TOKENS,
        extra_body=EXTRA, **kw,
    )  # fmt: skip


def wav_of(data: str) -> tuple[int, int, bytes]:
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        return w.getframerate(), w.getnchannels(), w.readframes(w.getnframes())


def expected_pcm(folder: str, voice: str):
    """transformers' reply: its text ids and its waveform as 16-bit samples."""
    ref = reference_generate(
        folder, MESSAGES, voice=voice, thinker_max_new_tokens=THINKER_TOKENS,
        talker_max_new_tokens=TALKER_TOKENS,
    )  # fmt: skip
    pcm = np.frombuffer(OmniAudio(ref.waveform, 24000).pcm16(), dtype="<i2")
    return ref.thinker_ids, pcm


def assert_samples(frames: bytes, expected: np.ndarray) -> None:
    """16-bit samples equal, up to one rounding step: the stage processes may run another
    number of torch threads than the reference, and a float sum in another order may cross a
    half-step (on the development machine they are equal)."""
    got = np.frombuffer(frames, dtype="<i2")
    assert got.shape == expected.shape
    assert int(np.abs(got.astype(np.int32) - expected).max()) <= 1


def test_models_lists_text_and_audio(client):
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["modalities"] == ["text", "audio"]
    assert [s["name"] for s in model.model_extra["stages"]] == ["thinker", "talker", "code2wav"]


@pytest.mark.parametrize("voice", VOICES)
def test_each_voice_of_the_checkpoint_speaks_transformers_waveform(client, folder, voice):
    reply = speak(client, voice)
    ids, expected = expected_pcm(folder, voice)
    message = reply.choices[0].message
    assert message.audio is not None and message.audio.transcript == message.content
    assert reply.usage.completion_tokens == len(ids)
    rate, channels, frames = wav_of(message.audio.data)
    assert (rate, channels) == (24000, 1)
    assert_samples(frames, expected)


def test_streamed_delta_audio_joins_into_the_whole_reply(client):
    whole = wav_of(speak(client, "ethan").choices[0].message.audio.data)[2]
    chunks = list(speak(client, "ethan", stream=True))
    parts = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert len({p.id for p in parts}) == 1 and parts[-1].expires_at > 0
    streamed = b"".join(base64.b64decode(p.data) for p in parts if p.data)
    assert wav_of(base64.b64encode(streamed).decode())[2] == whole


VIDEO = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]


def mp4_part() -> list[dict]:
    from tests.unit.entrypoints.test_media import video_bytes

    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(seconds=1)).decode()
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What?"}]


def test_a_video_prompt_is_answered(server):
    body = {"messages": [{"role": "user", "content": mp4_part()}], "modalities": ["text"]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body | {"max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 8  # the video's placeholders


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
        ({"audio_params": {"voice": "nobody"}}, "audio_params.voice"),
        ({"messages": [{"role": "user", "content": VIDEO}]}, "video"),
        (
            {
                "messages": [{"role": "user", "content": mp4_part()}],
                "mm_processor_kwargs": {"fps": 3},
            },
            "mm_processor_kwargs.fps",
        ),
    ],
)
def test_bad_speech_requests_are_400_naming_the_field(server, change, field):
    body = {"messages": MESSAGES, "modalities": ["text", "audio"], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body | EXTRA | change, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in (error["param"] or "") + error["message"]
