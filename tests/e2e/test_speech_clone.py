"""A cloned voice over HTTP (``omnistage serve --pipeline tiny-qwen3-tts-base``): the official
openai client's ``audio.speech.create`` with ``ref_audio`` (a ``data:`` URI of a WAV) answers
the official ``qwen-tts`` package's ``generate_voice_clone`` for the same clip (its greedy
codes decoded, the reference's frames cut), in context (``ref_text``) and with the x-vector
only; plain base64 is the same clip; streamed (the preset's code2wav edge streams), a clone in
context's joined bytes are the whole answer's. Each bad clone is a 400 naming the field (no clip, no
transcript, an undecodable or too long clip, a task the checkpoint does not do), and the server
speaks on; a clone is the same after each stage slept at level 1 and 2 (the talker's encoders
reloaded from their files). A voice uploaded through ``POST /v1/audio/voices`` (with or without its transcript)
speaks as its clip given as ``ref_audio``; it is listed, deleted, and each bad upload is a 400
naming the form field. A ``speaker_embedding`` (the clip's x-vector, computed already: in the
body or uploaded as a voice) speaks as the clip's x-vector clone."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import openai
import pytest
import torch

from omnistage.models.tiny import ensure_preset
from tests.e2e.server import running_server
from tests.unit.models.qwen3_tts.checkpoints import load_base

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PRESET = "tiny-qwen3-tts-base"
TEXT = "Hello there, how are you"
REF_TEXT = "this is what the clip says"
FRAMES = 8
GREEDY = {"language": "english", "temperature": 0, "max_new_tokens": FRAMES}


def clip_wav(seconds: float, rate: int = 24000) -> tuple[bytes, np.ndarray]:
    """A seeded 16-bit mono WAV and the float32 samples a decoder reads from it."""
    n = round(seconds * rate)
    t = np.arange(n) / rate
    noise = np.random.default_rng(n).standard_normal(n)
    pcm = (np.clip(0.4 * np.sin(2 * np.pi * 210 * t) + 0.1 * noise, -1, 1) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    return out.getvalue(), pcm.astype(np.float32) / 32768.0


WAV, SAMPLES = clip_wav(1.7)
DATA_URI = "data:audio/wav;base64," + base64.b64encode(WAV).decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return ensure_preset(PRESET, cache / PRESET), cache


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """The preset's built-in pipeline, each stage on one torch thread (as the reference below
    runs: the same float sums, bit for bit)."""
    from importlib import resources

    import yaml

    data = yaml.safe_load(
        resources.files("omnistage.pipelines").joinpath(f"{PRESET}.yaml").read_text()
    )
    for stage in data["stages"]:
        stage["model"] = stage["model"].format(cache=folder[1])
        stage["torch_threads"] = 1
    path = tmp_path_factory.mktemp("pipeline") / f"{PRESET}.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {"OMNISTAGE_CACHE_DIR": str(folder[1])}
    voices = tmp_path_factory.mktemp("voices")
    args = ("--voice-storage-dir", str(voices), "--max-uploaded-voices", "2")
    args += ("--enable-sleep-mode",)
    with running_server("--config", str(path), *args, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(folder):
    return load_base(folder[0])


def reference_pcm(model, xvec: bool) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wavs, rate = model.generate_voice_clone(
            TEXT, language="english", ref_audio=(SAMPLES, 24000),
            ref_text=None if xvec else REF_TEXT, x_vector_only_mode=xvec,
            max_new_tokens=FRAMES, do_sample=False, subtalker_dosample=False,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert rate == 24000
    return (np.clip(wavs[0], -1, 1) * 32767.0).round().astype("<i2")


def speak(client, **extra) -> bytes:
    body = {**GREEDY, "task_type": "Base", **extra}
    reply = client.audio.speech.create(  # the client always names a voice: a clone's is its clip
        model=PRESET, input=TEXT, voice="clone", response_format="pcm", extra_body=body
    )
    return reply.content


def assert_same(got: bytes, want: np.ndarray) -> None:
    ours = np.frombuffer(got, dtype="<i2")
    assert len(ours) == len(want) and len(want) >= 1920
    diff = np.abs(ours.astype(np.int32) - want.astype(np.int32))
    assert np.array_equal(ours, want), (diff.max(), (diff > 0).sum(), np.argmax(diff > 0))


def test_a_clone_in_context_is_the_packages(client, reference):
    got = speak(client, ref_audio=DATA_URI, ref_text=REF_TEXT)
    assert_same(got, reference_pcm(reference, xvec=False))


def test_a_streamed_clone_in_context_joins_into_the_whole_answer(client):
    """The preset's code2wav edge streams: the reference's frames reach it first (the talker's
    first update), their samples cut as the whole decode cuts them."""
    body = {**GREEDY, "task_type": "Base", "ref_audio": DATA_URI, "ref_text": REF_TEXT}
    with client.audio.speech.with_streaming_response.create(
        model=PRESET, input=TEXT, voice="clone", response_format="pcm", stream_format="audio",
        extra_body=body,
    ) as reply:  # fmt: skip
        joined = b"".join(reply.iter_bytes())
    assert joined == speak(client, ref_audio=DATA_URI, ref_text=REF_TEXT)


def test_an_x_vector_clone_is_the_packages(client, reference):
    got = speak(client, ref_audio=DATA_URI, x_vector_only_mode=True)
    assert_same(got, reference_pcm(reference, xvec=True))
    plain = speak(client, ref_audio=base64.b64encode(WAV).decode(), x_vector_only_mode=True)
    assert plain == got


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"ref_text": REF_TEXT}, "ref_audio"),
        ({"ref_audio": DATA_URI}, "ref_text"),
        ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(b"not audio").decode(),
          "ref_text": REF_TEXT}, "ref_audio"),
        ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(clip_wav(31, 8000)[0])
          .decode(), "ref_text": REF_TEXT}, "ref_audio"),
        ({"ref_audio": DATA_URI, "ref_text": REF_TEXT, "task_type": "CustomVoice"}, "task_type"),
    ],
)  # fmt: skip
def test_a_bad_clone_is_a_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        speak(client, **extra)
    assert field in str(err.value)


def x_vector(reference) -> list[float]:
    """The package's x-vector of the clip (``extract_speaker_embedding``), as JSON floats."""
    with torch.no_grad():
        vector = reference.model.extract_speaker_embedding(SAMPLES, 24000)
    return [float(x) for x in vector.float()]


def test_a_given_embedding_speaks_as_its_clips_x_vector(client, reference):
    """float32 values as JSON numbers and back are the same bits: the same speech."""
    got = speak(client, speaker_embedding=x_vector(reference))
    assert got == speak(client, ref_audio=DATA_URI, x_vector_only_mode=True)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"speaker_embedding": [0.1, 0.2]}, "speaker_embedding"),
        ({"speaker_embedding": [0.1] * 8, "ref_audio": DATA_URI}, "speaker_embedding"),
        ({"speaker_embedding": "0.1"}, "speaker_embedding"),
    ],
)
def test_a_bad_embedding_is_a_400_naming_it(client, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        speak(client, **extra)
    assert field in str(err.value)


def test_the_server_speaks_on(client):
    assert len(speak(client, ref_audio=DATA_URI, x_vector_only_mode=True)) >= 2 * 1920


def upload(server, name: str, wav: bytes | None = WAV, **fields) -> httpx.Response:
    form = {"name": name, "consent": "consent-1", **fields}
    files = {"audio_sample": ("clip.wav", wav, "audio/wav")} if wav is not None else None
    return httpx.post(server.url + "/v1/audio/voices", data=form, files=files, timeout=60)


def delete(server, name: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/v1/audio/voices/{name}", timeout=30)


def test_an_uploaded_voice_speaks_as_its_clip(server, client):
    reply = upload(server, "Alice", ref_text=REF_TEXT)
    assert reply.status_code == 200, reply.text
    voice = reply.json()["voice"]
    assert (voice["name"], voice["ref_text"], voice["file_size"]) == ("Alice", REF_TEXT, len(WAV))
    assert upload(server, "bob").status_code == 200  # no transcript: the x-vector alone
    try:
        listed = httpx.get(server.url + "/v1/audio/voices", timeout=30).json()
        assert [v["name"] for v in listed["uploaded_voices"]] == ["Alice", "bob"]
        in_context = speak(client, ref_audio=DATA_URI, ref_text=REF_TEXT)
        assert speak(client, voice="alice") == in_context  # names match in any case
        assert speak(client, voice="bob") == speak(
            client, ref_audio=DATA_URI, x_vector_only_mode=True
        )
        reply = upload(server, "carol")  # --max-uploaded-voices 2
        assert reply.status_code == 400 and "name" in reply.text
    finally:
        assert delete(server, "ALICE").status_code == 200
        assert delete(server, "bob").status_code == 200
    assert delete(server, "bob").status_code == 404
    assert httpx.get(server.url + "/v1/audio/voices", timeout=30).json()["uploaded_voices"] == []


def test_an_uploaded_embedding_speaks_as_its_clips_x_vector(server, client, reference):
    import json

    vector = x_vector(reference)
    reply = upload(server, "Eve", None, speaker_embedding=json.dumps(vector))
    assert reply.status_code == 200, reply.text
    voice = reply.json()["voice"]
    assert (voice["embedding_source"], voice["embedding_dim"]) == ("direct", len(vector))
    try:
        assert speak(client, voice="eve") == speak(client, speaker_embedding=vector)
    finally:
        assert delete(server, "eve").status_code == 200


@pytest.mark.parametrize(
    ("name", "wav", "fields", "field"),
    [
        ("", WAV, {}, "name"),
        ("../etc", WAV, {}, "name"),
        ("dave", b"not audio", {}, "audio_sample"),
        ("dave", clip_wav(31, 8000)[0], {}, "audio_sample"),
        ("dave", WAV, {"speaker_embedding": "[0.1]"}, "speaker_embedding"),  # both
        ("dave", None, {"speaker_embedding": "[0.1, 0.2]"}, "speaker_embedding"),  # its width
        ("dave", None, {"speaker_embedding": "[0.1,"}, "speaker_embedding"),
        ("dave", None, {"speaker_embedding": '["a"]'}, "speaker_embedding"),
        ("dave", None, {}, "audio_sample"),
        ("dave", WAV, {"surprise": "1"}, "surprise"),
    ],
)
def test_a_bad_upload_is_a_400_naming_the_field(server, name, wav, fields, field):
    reply = upload(server, name, wav, **fields)
    assert reply.status_code == 400 and field in reply.json()["error"]["message"], reply.text
    assert httpx.get(server.url + "/v1/audio/voices", timeout=30).json()["uploaded_voices"] == []


@pytest.mark.parametrize("level", [1, 2])
def test_a_clone_is_the_same_after_each_stage_slept(server, client, level):
    before = speak(client, ref_audio=DATA_URI, ref_text=REF_TEXT)
    for stage in (0, 1):
        body = {"stage_ids": [stage], "level": level}
        reply = httpx.post(server.url + "/v1/omni/sleep", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        reply = httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [stage]}, timeout=60)
        assert reply.status_code == 200 and reply.json()["status"] == "SUCCESS", reply.text
    assert speak(client, ref_audio=DATA_URI, ref_text=REF_TEXT) == before
