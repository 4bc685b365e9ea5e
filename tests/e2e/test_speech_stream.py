"""Qwen3-TTS speech streamed from the frames as the talker makes them (``omnistage serve
--pipeline tiny-qwen3-tts-customvoice``, its code2wav edge ``stream: true``): the official
openai client's ``with_streaming_response ... iter_bytes`` gets the first audio long before the
last (the talker still speaking), and the joined bytes are the non-streamed answer's for the
same seed, bit for bit; Server-Sent Events carry the same speech in several pieces, the first
of them a part. ``initial_codec_chunk_frames`` sends an early first piece of that many frames
(not final), every later byte the whole answer's. (The tiny decoder's convolutions run the whole window's kernels from 161
frames on, so its speech streams past 176 frames: docs/tts.md, *Streamed speech*.)"""

from __future__ import annotations

import base64
import json
import time

import httpx
import openai
import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "tiny-qwen3-tts-customvoice"
# seed 46 speaks past 260 frames (no codec end before it): 259 frames, 3 chunks
SPEECH = {"model": MODEL, "input": "Hello there, how are you today?", "voice": "vivian",
          "response_format": "pcm"}  # fmt: skip
EXTRA = {"language": "english", "seed": 46, "max_new_tokens": 260}
FRAME_BYTES = 1920 * 2  # 16-bit samples


@pytest.fixture(scope="module")
def server():
    with running_server("--pipeline", MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def whole(client) -> bytes:
    return client.audio.speech.create(**SPEECH, extra_body=EXTRA).content


def test_the_streamed_bytes_are_the_whole_answers_and_come_early(client, whole):
    assert len(whole) == 259 * FRAME_BYTES
    reads: list[tuple[float, bytes]] = []
    started = time.perf_counter()
    with client.audio.speech.with_streaming_response.create(
        **SPEECH, stream_format="audio", extra_body=EXTRA
    ) as reply:
        assert reply.headers["content-type"].startswith("audio/pcm")
        for data in reply.iter_bytes():
            reads.append((time.perf_counter() - started, data))
    assert b"".join(data for _, data in reads) == whole  # bit for bit
    first, last = reads[0][0], reads[-1][0]
    early = sum(len(data) for at, data in reads if at < last - 0.5)
    # the first chunk (88 frames, final once 176 are in) well before the talker's last frame
    assert 0 < early < len(whole) and first < last - 0.5


def test_server_sent_events_carry_the_speech_in_pieces(server, whole):
    body = {**SPEECH, **EXTRA, "stream_format": "sse"}
    reply = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    pieces = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert [len(p) // FRAME_BYTES for p in pieces] == [88, 32, 139]
    assert b"".join(pieces) == whole


def test_an_early_first_chunk_then_the_exact_bytes(server, whole):
    """``initial_codec_chunk_frames``: the first piece is those frames, decoded from them alone
    (not final: near the whole answer's, not equal); every later byte is the whole answer's."""
    body = {**SPEECH, **EXTRA, "stream_format": "sse", "initial_codec_chunk_frames": 8}
    reply = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    pieces = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert len(pieces[0]) == 8 * FRAME_BYTES and len(pieces) >= 3
    joined = b"".join(pieces)
    assert len(joined) == len(whole) and joined[len(pieces[0]) :] == whole[len(pieces[0]) :]
