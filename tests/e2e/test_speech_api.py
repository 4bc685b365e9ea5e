"""Qwen3-TTS over HTTP (``omnistage serve --model DIR``, talker -> code2wav): the official
openai client's ``audio.speech.create`` answers the official ``qwen-tts`` package's waveform
for the same ids (its greedy ``generate`` decoded by its speech tokenizer; 16-bit samples
within one step, the server's stages computing on their own threads), as pcm and as wav;
streamed as raw audio (``with_streaming_response ... iter_bytes``) and as Server-Sent Events,
the same bytes; 8 requests at once each speak as alone; AAC and a faster speed answer the same
speech; a seeded sampled request speaks the same twice; time to first audio and the real-time
factor reach /metrics; a batch answers each item on its own. ``GET /v1/audio/voices`` lists
the checkpoint's speakers.
Bad input is a 400 naming the field, and the server speaks on."""

from __future__ import annotations

import base64
import io
import json
import wave

import httpx
import numpy as np
import openai
import pytest
import torch

from omnistage.models.qwen3_tts.prompt import assistant_text
from omnistage.models.tokenizer import Tokenizer
from tests.e2e.server import running_server
from tests.unit.models.qwen3_tts.checkpoints import write_codec, write_talker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXT = "Hello there, how are you"
FRAMES = 8
GREEDY = {"language": "english", "temperature": 0, "max_new_tokens": FRAMES}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-tts")
    return folder, write_talker(folder), write_codec(folder)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ("--model", str(checkpoint[0]), "--served-model-name", "tiny-qwen3-tts")
    args += ("--max-model-len", "256", "--kv-cache-memory", "4MiB")
    args += ("--voice-storage-dir", str(tmp_path_factory.mktemp("voices")))
    with running_server(*args) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_pcm(checkpoint, voice: str) -> np.ndarray:
    """The package's greedy speech of ``TEXT`` as 16-bit samples."""
    folder, talker, codec = checkpoint
    ids = Tokenizer.from_pretrained(folder).encode(assistant_text(TEXT))
    with torch.no_grad():
        codes, _ = talker.generate(
            input_ids=[torch.tensor([ids])], instruct_ids=[None], languages=["english"],
            speakers=[voice], non_streaming_mode=True, max_new_tokens=FRAMES, do_sample=False,
            subtalker_dosample=False,
        )  # fmt: skip
        ((wav,),) = codec.decode(codes[0][None], return_dict=False)
    return (np.clip(wav.float().numpy(), -1, 1) * 32767.0).round().astype("<i2")


def samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2")


def assert_same_speech(got: np.ndarray, want: np.ndarray) -> None:
    assert len(got) == len(want) and len(want) >= 2 * 1920
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


@pytest.fixture(scope="module")
def spoken(client) -> bytes:
    reply = client.audio.speech.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", response_format="pcm",
        extra_body=GREEDY,
    )  # fmt: skip
    return reply.content


def test_the_openai_client_gets_the_packages_speech(checkpoint, spoken):
    assert_same_speech(samples(spoken), reference_pcm(checkpoint, "vivian"))


def test_a_wav_carries_the_same_samples(client, spoken):
    reply = client.audio.speech.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", extra_body=GREEDY
    )
    with wave.open(io.BytesIO(reply.content)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        assert wav.readframes(wav.getnframes()) == spoken


def test_streamed_raw_audio_is_the_same_bytes(client, spoken):
    with client.audio.speech.with_streaming_response.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", response_format="pcm",
        stream_format="audio", extra_body=GREEDY,
    ) as reply:  # fmt: skip
        assert reply.headers["content-type"].startswith("audio/pcm")
        assert b"".join(reply.iter_bytes()) == spoken


def test_server_sent_events_carry_the_same_bytes(server, spoken):
    body = {"input": TEXT, "voice": "vivian", "response_format": "pcm", "stream_format": "sse",
            **GREEDY}  # fmt: skip
    reply = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=120)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and all(e["response_format"] == "pcm" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == spoken


def test_the_voices_are_the_checkpoints_speakers(server):
    reply = httpx.get(server.url + "/v1/audio/voices", timeout=30)
    assert reply.json() == {"voices": ["dylan", "vivian"], "uploaded_voices": []}


@pytest.mark.parametrize(
    ("change", "param", "said"),
    [
        ({"voice": "nobody"}, "voice", "unknown voice 'nobody'"),
        ({"language": "klingon"}, "language", "unknown language 'klingon'"),
        ({"speed": 2.0, "stream_format": "audio"}, "speed", "not time-stretched"),
        ({"speed": 5.0}, "speed", ""),
        ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio", "cannot decode"),
        ({"ref_text": "hello"}, "ref_text", "which a Base checkpoint does"),
        ({"x_vector_only_mode": True}, "x_vector_only_mode", "which a Base checkpoint does"),
        ({"task_type": "VoiceDesign"}, "task_type", "does not do VoiceDesign"),
        ({"input": ""}, "input", ""),
        ({"stream_format": "audio", "response_format": "mp3"}, "response_format", "wav or pcm"),
        ({"surprise": 1}, "surprise", ""),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, change, param, said):
    body = {"input": TEXT, "voice": "vivian", **GREEDY, **change}
    reply = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and said in error["message"]


def test_eight_requests_at_once_each_speak_as_alone(server):
    import asyncio

    cases = [(text, voice) for text in (TEXT, "A second one", "Third", "And four") for voice in
             ("vivian", "dylan")]  # fmt: skip

    async def speak(http, text: str, voice: str) -> bytes:
        body = {"input": text, "voice": voice, "response_format": "pcm", **GREEDY}
        reply = await http.post(server.url + "/v1/audio/speech", json=body)
        assert reply.status_code == 200, reply.text
        return reply.content

    async def run() -> tuple[list[bytes], list[bytes]]:
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [await speak(http, *case) for case in cases]
            together = await asyncio.gather(*(speak(http, *case) for case in cases))
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone and len(set(alone)) == len(cases)


def test_aac_and_another_speed_are_the_same_speech(client, spoken):
    from omnistage.entrypoints.media.decode import decode_audio
    from omnistage.entrypoints.media.policy import MediaPolicy

    reply = client.audio.speech.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", response_format="aac",
        extra_body=GREEDY,
    )  # fmt: skip
    assert reply.response.headers["content-type"] == "audio/aac"
    heard = decode_audio(reply.content, "aac", MediaPolicy())
    assert heard.sampling_rate == 24000 and abs(len(heard.samples) - len(spoken) // 2) <= 2048
    faster = client.audio.speech.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", response_format="pcm", speed=2.0,
        extra_body=GREEDY,
    )  # fmt: skip
    assert len(faster.content) // 2 == len(spoken) // 2 // 2


def test_an_uploaded_voice_on_a_checkpoint_that_does_not_clone_is_a_400_naming_voice(server):
    clip = io.BytesIO()
    with wave.open(clip, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(24000)
        wav.writeframes(np.zeros(24000, "<i2").tobytes())
    files = {"audio_sample": ("clip.wav", clip.getvalue(), "audio/wav")}
    form = {"name": "mine", "consent": "c-1"}
    reply = httpx.post(server.url + "/v1/audio/voices", data=form, files=files, timeout=60)
    assert reply.status_code == 200, reply.text
    try:
        body = {"input": TEXT, "voice": "mine", **GREEDY}
        reply = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "voice", reply.text
        assert "uploaded voice" in reply.json()["error"]["message"]
    finally:
        httpx.delete(server.url + "/v1/audio/voices/mine", timeout=30)


def test_the_server_speaks_on_after_bad_input(client, spoken):
    reply = client.audio.speech.create(
        model="tiny-qwen3-tts", input=TEXT, voice="vivian", response_format="pcm",
        extra_body=GREEDY,
    )  # fmt: skip
    assert reply.content == spoken


def test_a_seeded_sampled_request_speaks_the_same_twice(client):
    def speak(seed: int) -> bytes:
        return client.audio.speech.create(
            model="tiny-qwen3-tts", input=TEXT, voice="dylan", response_format="pcm",
            extra_body={"language": "chinese", "max_new_tokens": FRAMES, "seed": seed},
        ).content  # fmt: skip

    first = speak(5)
    assert speak(5) == first and len(first) > 0
    assert speak(6) != first  # the package's sampling (temperature 0.9, top-k 50) draws


def test_time_to_first_audio_and_real_time_factor_are_in_metrics(server, spoken):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in ("time_to_first_audio_seconds", "audio_real_time_factor"):
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"omnistage:{family}_count") and 'stage="1"' in line  # code2wav
        ]
        assert counts and counts[0] > 0, family


def test_a_batch_speaks_each_item_and_fails_only_the_bad_one(server, spoken):
    body = {
        "items": [
            {"input": TEXT, "voice": "vivian"},
            {"input": TEXT, "voice": "nobody"},
            {"input": TEXT, "voice": "vivian", "response_format": "wav"},
        ],
        "response_format": "pcm",
        **GREEDY,
    }
    reply = httpx.post(server.url + "/v1/audio/speech/batch", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert (answer["total"], answer["succeeded"], answer["failed"]) == (3, 2, 1)
    good, bad, wav = answer["results"]
    assert [r["index"] for r in answer["results"]] == [0, 1, 2]
    assert good["status"] == "success" and good["media_type"] == "audio/pcm"
    assert base64.b64decode(good["audio_data"]) == spoken
    assert bad["status"] == "error" and "unknown voice 'nobody'" in bad["error"]
    assert wav["media_type"] == "audio/wav" and base64.b64decode(wav["audio_data"])[:4] == b"RIFF"
    too_many = httpx.post(
        server.url + "/v1/audio/speech/batch", json={"items": [{"input": "x"}] * 33}, timeout=30
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "items"
