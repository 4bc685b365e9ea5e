"""A real ``omnistage serve --model DIR`` on a tiny Qwen2.5-Omni checkpoint: the official
``openai`` client gets speech as OpenAI defines it (``message.audio`` with a 24 kHz WAV,
streamed as ``delta.audio``), the seed's sleep sequence leaves the audio unchanged, text keeps
working while the talker sleeps, and bad requests are 400s naming the field."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import signal
import time
import wave

import httpx
import openai
import pytest

from omnistage.pipelines import load_pipeline
from tests.e2e.server import running_server
from tests.e2e.speech_omni import *  # noqa: F403 - the speech route's tests, on this server
from tests.qwen2_5_omni_media import openai_parts, png_url

SPEAK = {
    "modalities": ["text", "audio"],
    "audio": {"voice": "Chelsie", "format": "wav"},
    "temperature": 0,
    "max_tokens": 6,
    "seed": 5,
}
EXTRA = {"talker_params": {"temperature": 0, "max_tokens": 16}, "audio_params": {"num_steps": 4}}
MESSAGES = [{"role": "user", "content": "Say something"}]
MODEL = "tiny-qwen2.5-omni"  # the checkpoint folder's name: the served model's


@pytest.fixture(scope="module")
def preset() -> str:
    """The built-in pipeline whose folder this module's server serves (``speech_omni``)."""
    return "tiny-qwen2.5-omni"


@pytest.fixture(scope="module")
def server():
    folder = load_pipeline("tiny-qwen2.5-omni").stages[0].model  # built on first use
    # The decoded media of all requests at once: room for one 48 kHz FLAC of 200 s (38 MB).
    budget = ["--max-media-decoded-bytes-in-flight", "64MiB"]
    with running_server("--model", folder, "--enable-sleep-mode", *budget) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wav_of(data: str | bytes) -> tuple[int, int, bytes]:
    """A WAV's rate, channels and frames (a streamed one's sizes say "unknown": read to the
    end)."""
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        return w.getframerate(), w.getnchannels(), w.readframes(w.getnframes())


def speak(server) -> dict:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MESSAGES, **SPEAK, **EXTRA},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_models_lists_text_and_audio(client):
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["modalities"] == ["text", "audio"]
    assert [s["name"] for s in model.model_extra["stages"]] == ["thinker", "talker", "code2wav"]


def test_the_openai_client_gets_a_24khz_wav(client):
    import warnings

    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, audio={"voice": "Chelsie", "format": "wav"},
        modalities=["text", "audio"], temperature=0, max_tokens=6, seed=5, extra_body=EXTRA,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reply.model_dump()
    message = reply.choices[0].message
    assert message.audio is not None and message.audio.id and message.audio.expires_at > 0
    assert message.audio.transcript == message.content
    rate, channels, frames = wav_of(message.audio.data)
    assert (rate, channels) == (24000, 1) and len(frames) > 0


def test_streaming_sends_the_same_audio_as_delta_audio(client, server):
    whole = speak(server)["audio"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            audio={"voice": "Chelsie", "format": "wav"},
            modalities=["text", "audio"],
            temperature=0,
            max_tokens=6,
            seed=5,
            stream=True,
            extra_body=EXTRA,
        )  # fmt: skip
    )
    parts = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert len({p.id for p in parts}) == 1
    assert parts[0].transcript == whole["transcript"] and parts[-1].expires_at > 0
    streamed = b"".join(base64.b64decode(p.data) for p in parts if p.data)
    assert wav_of(base64.b64encode(streamed))[2] == wav_of(whole["data"])[2]


def test_pcm16_is_raw_samples(server):
    body = {"messages": MESSAGES, **SPEAK, **EXTRA, "audio": {"format": "pcm16"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    pcm = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    _, _, frames = wav_of(speak(server)["audio"]["data"])
    assert pcm == frames


def test_the_seeds_sleep_sequence_leaves_the_audio_unchanged(server):
    before = speak(server)["audio"]
    for body in (
        {"stage_ids": [0], "level": 2},
        {"stage_ids": [1], "level": 1},
        {"stage_ids": [0, 1]},
    ):
        r = httpx.post(server.url + "/v1/omni/sleep", json=body, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [0, 1]}, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
    after = speak(server)["audio"]
    assert wav_of(after["data"]) == wav_of(before["data"])
    assert after["transcript"] == before["transcript"]


def test_text_works_while_the_talker_sleeps_and_audio_is_503(server):
    r = httpx.post(server.url + "/v1/omni/sleep", json={"stage_ids": [1], "level": 1}, timeout=60)
    assert r.status_code == 200
    try:
        text = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 4, "modalities": ["text"]},
            timeout=60,
        )
        assert text.status_code == 200 and text.json()["choices"][0]["message"]["audio"] is None
        # Without modalities a request asks for speech too (vLLM-Omni's default): 503.
        default = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 4},
            timeout=60,
        )
        assert default.status_code == 503 and default.headers["Retry-After"] == "1"
        speech = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MESSAGES, **SPEAK, **EXTRA},
            timeout=60,
        )
        assert speech.status_code == 503 and "stage 1 is asleep" in speech.text
    finally:
        httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [1]}, timeout=60)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"audio": {"voice": "Nobody"}}, "audio.voice"),
        ({"audio": {"format": "aac"}}, "audio.format"),
        ({"modalities": ["text"], "audio": {"voice": "Chelsie"}}, "audio"),
        ({"talker_params": {"temperature": -1}}, "talker_params.temperature"),
        ({"talker_params": {"n": 4}}, "talker_params.n"),  # refused before any stage runs
        ({"audio_params": {"num_steps": 4, "voice": "Ethan"}}, "audio_params.voice"),
        ({"audio_params": {"num_steps": 0}}, "audio_params.num_steps"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "input_audio",
        ),
    ],
)
def test_bad_speech_requests_are_400_naming_the_field(server, change, field):
    body = {"messages": MESSAGES, **SPEAK, **EXTRA, **change}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_audio_from_a_pipeline_without_a_speaker_is_400(plain_server):
    body = {"messages": MESSAGES, "modalities": ["text", "audio"], "max_tokens": 2}
    r = httpx.post(plain_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "modalities" in r.json()["error"]["message"]


# -- audio and pictures in ---------------------------------------------------------------


def test_the_openai_client_sends_audio_and_pictures_and_hears_transformers_reply(client, server):
    from tests.qwen2_5_omni_media import hf_process, hf_processor
    from tests.qwen2_5_omni_reference import reference_generate

    folder = load_pipeline("tiny-qwen2.5-omni").stages[0].model
    parts, messages, options, kw = openai_parts("audio_image")
    reply = client.chat.completions.create(
        model=MODEL, messages=parts, audio={"voice": "Chelsie", "format": "wav"},
        modalities=["text", "audio"], temperature=0, max_tokens=6, seed=5,
        extra_body={**EXTRA, "mm_processor_kwargs": options},
    )  # fmt: skip
    _, processed = hf_process(hf_processor(folder), messages, options, kw)
    ref = reference_generate(
        folder, processed["input_ids"][0].tolist(), voice="Chelsie", seed=5,
        thinker_max_new_tokens=6, talker_max_new_tokens=16, num_steps=4,
        processor_outputs=dict(processed),
    )  # fmt: skip
    message = reply.choices[0].message
    assert reply.usage.prompt_tokens == processed["input_ids"].shape[1]
    assert reply.usage.completion_tokens == len(ref.thinker_ids)
    rate, _, frames = wav_of(message.audio.data)
    import numpy as np

    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767
    expected = np.clip(ref.waveform, -1, 1)
    assert rate == 24000 and samples.shape == expected.shape
    assert float(np.abs(samples - expected).max()) <= 2e-3 * float(np.abs(expected).max())


MEDIA_ERRORS = [
    ([{"type": "input_audio", "input_audio": {"data": "AAAA" * 64, "format": "wav"}}],
     {}, "messages.0.content.0.input_audio.data"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}],
     {}, "messages.0.content.0.input_audio.format"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
     {}, "messages.0.content.0.image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}],
     {}, "messages.0.content.0.image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}],
     {}, "messages.0.content.0.image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 5,
     {}, "messages"),
    ([{"type": "video_url", "video_url": {"url": "data:audio/wav;base64,AAAA"}}],
     {}, "messages.0.content.0.video_url.url"),
    ([{"type": "image_url"}], {}, "image_url"),
    ([{"type": "text", "text": "hi"}], {"mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "extra", "field"), MEDIA_ERRORS)
def test_bad_media_is_a_400_naming_the_part_and_the_stage_lives_on(server, content, extra, field):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "modalities": ["text"]},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def _short_audio_part() -> dict:
    import numpy as np

    from tests.qwen2_5_omni_media import wav_data

    data = wav_data(np.zeros(1, np.float32))  # one sample: shorter than a feature frame
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        # the stage's check of its first medium, named as the part the body sent
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, "AUDIO"]}]},
            "messages.0.content.1.input_audio",
        ),
        ({"speaker": "Chelsie", "voice": "Ethan"}, "voice"),  # a check across fields
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"media_io_kwargs": {"video": {"fps": 2}}}, "media_io_kwargs"),  # no media part
    ],
)
def test_the_400_names_the_field_as_the_body_has_it(server, change, param):
    """``param`` is the body's own path: not the stage's ``multi_modal_data[0]``, nor null
    for a check across fields, nor the mm_processor_kwargs a media_io_kwargs option joins."""
    body = {"messages": MESSAGES, "max_tokens": 2, "modalities": ["text"], **change}
    for message in body["messages"]:
        if isinstance(message["content"], list):
            message["content"] = [
                _short_audio_part() if p == "AUDIO" else p for p in message["content"]
            ]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_decoded_media_leave_the_budget_once_their_prompt_is_prepared(server):
    """Each 200 s FLAC decodes to 38 MB, the budget holds 64 MB: one after another they are
    all answered at once (a request's decoded samples leave the budget when its prompt has
    been prepared, here refused as too long); four at once wait their turns; one larger than
    the budget is a 400 naming it."""
    import numpy as np
    import soundfile

    def flac(seconds: float) -> dict:
        out = io.BytesIO()
        soundfile.write(out, np.zeros(int(seconds * 48000), np.float32), 48000, format="FLAC")
        data = base64.b64encode(out.getvalue()).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": "flac"}}

    def ask(part: dict) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)

    part = flac(200)
    for _ in range(3):
        started = time.monotonic()
        reply = ask(part)
        assert reply.status_code == 400 and "context length" in reply.text, reply.text
        assert time.monotonic() - started < 20  # never the 30 s wait for room
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, [part] * 4))
    assert [r.status_code for r in replies] == [400] * 4, [r.text for r in replies]
    assert all("context length" in r.text for r in replies)
    too_big = ask(flac(400))  # 77 MB
    assert too_big.status_code == 400, too_big.text
    assert "--max-media-decoded-bytes-in-flight" in too_big.json()["error"]["message"]


def test_a_picture_for_a_model_without_a_vision_encoder_is_400(plain_server):
    from tests.qwen2_5_omni_media import picture

    content = [{"type": "image_url", "image_url": {"url": png_url(picture(32, 32))}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(plain_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "takes no image input" in r.json()["error"]["message"]


def test_bench_serve_times_the_first_audio(server, tmp_path):
    """``omnistage bench serve --modalities text,audio`` on this server: TTFA per request."""
    import json

    from omnistage import cli

    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2"]
    argv += ["--max-concurrency", "1", "--modalities", "text,audio", "--audio-voice", "Chelsie"]
    argv += ["--random-input-len", "4", "--random-output-len", "6", "--disable-progress"]
    argv += ["--extra-body", json.dumps({**EXTRA, "seed": 5}), "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "run.json"]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["n_ttfa"], result["model"]) == (2, 2, MODEL)
    assert 0 < result["mean_ttfa_ms"] <= result["mean_e2el_ms"]
    assert result["audio_out_s"] > 0  # read from the WAV headers of the streamed chunks


# -- speech streamed while the thinker thinks and the talker speaks (the pipeline's talker and
# code2wav edges have stream: true) ---------------------------------------------------------

LONG = {"talker_params": {"temperature": 0.9, "max_tokens": 160}, "audio_params": {"num_steps": 2}}


def stream_speech(
    server,
    extra: dict = LONG,
    seed: int = 5,
    stop_after: int | None = None,
    refused_ok: bool = False,
):
    """A streamed speech request: ``(pcm bytes of the decoded pieces, data pieces, finish
    reason, error)``; ``stop_after``: leave after that many data pieces; ``refused_ok``:
    None for a 503 (a stage it needs asleep when it came)."""
    body = {"messages": MESSAGES, **SPEAK, **extra, "seed": seed, "stream": True}
    body["audio"] = {"voice": "Chelsie", "format": "pcm16"}
    pcm, pieces, reason, error = b"", 0, None, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        if refused_ok and r.status_code == 503:  # came while a stage it needs slept
            assert r.headers["retry-after"]
            return None
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            error = error or event.get("error")
            for choice in event.get("choices", []):
                reason = choice.get("finish_reason") or reason
                data = (choice["delta"].get("audio") or {}).get("data")
                if data:
                    pcm, pieces = pcm + base64.b64decode(data), pieces + 1
            if stop_after is not None and pieces >= stop_after:
                break
    return pcm, pieces, reason, error


def stages(server) -> list[dict]:
    return httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"]


def wait_for_work(server, stage_id: int, counter: str, more: int) -> None:
    """Until the stage's ``counter`` grew by ``more`` (a request is under way there)."""
    start = stages(server)[stage_id][counter]
    deadline = time.monotonic() + 30
    while stages(server)[stage_id][counter] < start + more:
        assert time.monotonic() < deadline, f"stage {stage_id} did no work"
        time.sleep(0.01)


def wait_idle(server, deadline_s: float = 5.0) -> list[dict]:
    """The stages' status once none has a request in flight (``deadline_s`` at most)."""
    deadline = time.monotonic() + deadline_s
    while True:
        now = stages(server)
        busy = [s for s in now if s["in_flight"] or s.get("num_running") or s.get("num_waiting")]
        if not busy or time.monotonic() > deadline:
            assert not busy, busy
            return now
        time.sleep(0.05)


@pytest.fixture(scope="module")
def long_speech(server):
    return stream_speech(server)


def test_speech_comes_in_pieces_and_equals_the_unstreamed_answer(server, long_speech):
    pcm, pieces, reason, error = long_speech
    assert error is None and reason in ("stop", "length") and pieces >= 4  # 12, then 36 each
    body = {"messages": MESSAGES, **SPEAK, **LONG, "audio": {"format": "pcm16"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"]) == pcm


def test_metrics_time_the_first_audio_and_count_its_seconds(server, long_speech):
    from tests.e2e.test_metrics import SPEECH_FAMILIES, scrape, value

    samples = scrape(server)
    code2wav = {"stage": "2", "model_name": MODEL}
    assert value(samples, "omnistage:time_to_first_audio_seconds_count", **code2wav) >= 1
    ttfa = value(samples, "omnistage:time_to_first_audio_seconds_sum", **code2wav)
    e2e = value(samples, "omnistage:e2e_request_latency_seconds_sum", **code2wav)
    assert ttfa > 0
    assert value(samples, "omnistage:audio_seconds_total", **code2wav) > 0
    assert value(samples, "omnistage:audio_real_time_factor_count", **code2wav) >= 1
    assert value(samples, "omnistage:request_generation_tokens_count", stage="1") >= 1
    assert {name for name, _ in samples} >= {f + "_count" for f in SPEECH_FAMILIES} - {
        "omnistage:audio_seconds_total_count"
    }
    assert e2e > 0


def test_the_same_seed_gives_the_same_bytes_under_load(server, long_speech):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(stream_speech, server, LONG, seed) for seed in (5, 6, 7, 5)]
        results = [run.result() for run in runs]
    assert results[0][0] == long_speech[0] and results[3][0] == long_speech[0]
    assert results[1][0] != long_speech[0]


def test_a_client_that_leaves_mid_stream_stops_every_stage(server):
    pcm, pieces, _, _ = stream_speech(
        server, {**LONG, "talker_params": {"max_tokens": 1500}}, stop_after=1
    )
    assert pieces == 1
    before = wait_idle(server)
    time.sleep(0.3)
    after = stages(server)
    for key in ("num_generated_tokens", "num_synthesis_steps", "num_prefill_tokens"):
        assert [s.get(key) for s in after] == [s.get(key) for s in before], key
    talker = after[1]
    assert talker["num_free_kv_blocks"] == talker["num_kv_blocks"]  # its KV cache is free


@pytest.mark.parametrize("mode", ["abort", "keep"])
@pytest.mark.parametrize("stage_id", [1, 2])
def test_a_talker_or_code2wav_sleep_mid_stream_follows_its_mode(
    server, long_speech, mode, stage_id
):
    # Aborted: a reply long enough to be surely mid-way; kept: the one heard alone before.
    extra = {**LONG, "talker_params": {"max_tokens": 1500}} if mode == "abort" else LONG
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(stream_speech, server, extra)
        wait_for_work(server, 2, "num_synthesis_steps", 1)  # both are at work on it
        body = {"stage_ids": [stage_id], "level": 1, "mode": mode}
        r = httpx.post(server.url + "/v1/omni/sleep", json=body, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [stage_id]}, timeout=60)
        assert r.status_code == 200, r.text
        pcm, _, reason, error = run.result()
    if mode == "abort":
        assert reason == "abort" or error is not None
    else:
        assert (pcm, error) == (long_speech[0], None)  # kept, then finished as alone
    wait_idle(server)


def test_keep_sleeps_of_the_talker_at_random_moments_lose_no_streamed_request(server, long_speech):
    """Streamed speech requests start while the talker is put to sleep with ``keep`` and
    woken at random moments (some reach it asleep before their prompt came, some mid-reply):
    each ends within a bound with the bytes it gives alone, and nothing stays in flight."""
    import random

    rng = random.Random(42)
    short = {**LONG, "talker_params": {"temperature": 0.9, "max_tokens": 24}}
    alone = stream_speech(server, short)[0]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        runs = []
        for _ in range(6):
            runs += [pool.submit(stream_speech, server, short, refused_ok=True) for _ in range(2)]
            time.sleep(rng.uniform(0.0, 0.06))
            body = {"stage_ids": [1], "level": rng.choice([1, 2]), "mode": "keep"}
            r = httpx.post(server.url + "/v1/omni/sleep", json=body, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(rng.uniform(0.0, 0.05))
            r = httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [1]}, timeout=60)
            assert r.status_code == 200, r.text
        done, late = concurrent.futures.wait(runs, timeout=60)
        assert not late, f"{len(late)} of {len(runs)} streamed requests still running after 60 s"
    served = [run.result() for run in done if run.result() is not None]
    assert len(served) >= 3  # those that came while the talker was awake
    for pcm, _, reason, error in served:
        assert (error, reason) == (None, "length") and pcm == alone
    wait_idle(server)


def test_a_killed_talker_ends_the_stream_with_an_error_and_comes_back(server, long_speech):
    """Last in the module: the talker's process is killed and restarted."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(stream_speech, server, {**LONG, "talker_params": {"max_tokens": 4000}})
        wait_for_work(server, 2, "num_synthesis_steps", 1)  # speech on its way
        os.kill(stages(server)[1]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        _, _, reason, error = run.result()
        assert time.monotonic() - killed < 2.0
    assert error is not None or reason == "error"
    deadline = time.monotonic() + 60
    while stages(server)[1]["state"] != "awake" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stream_speech(server)[0] == long_speech[0]


# -- vLLM-Omni's shapes: a request without OpenAI's audio object ------------------------------
# (the rule and the shapes: omnistage/entrypoints/openai/dialect.py, docs/vllm-omni.md)

QUIET = {"max_tokens": 4, "temperature": 0, "seed": 5}


def test_a_vllm_omni_request_gets_text_and_speech_as_two_choices(client):
    """No modalities: every output the pipeline makes; the text choice first, both index 0."""
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, **QUIET, extra_body=EXTRA
    )
    text, speech = reply.choices
    assert (text.index, speech.index) == (0, 0)
    assert isinstance(text.message.content, str) and text.message.audio is None
    assert speech.message.content is None and speech.finish_reason == "stop"
    assert wav_of(speech.message.audio.data)[:2] == (24000, 1)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_a_vllm_omni_stream_tags_each_chunk_and_each_speech_chunk_is_a_wav(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, **QUIET, extra_body=EXTRA
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, **QUIET, stream=True, extra_body=EXTRA
        )
    )
    tagged = [(getattr(c, "modality", None), c) for c in chunks]
    text = "".join(c.choices[0].delta.content or "" for m, c in tagged if m == "text")
    speech = [c.choices[0].delta.content for m, c in tagged if m == "audio"]
    assert text == whole.choices[0].message.content
    assert speech and all(c.usage is not None for m, c in tagged if m == "audio")
    frames = b"".join(wav_of(piece)[2] for piece in speech)  # each a WAV of its own
    assert frames == wav_of(whole.choices[1].message.audio.data)[2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


VLLM_OMNI_LIST = [  # vLLM-Omni's Qwen2.5-Omni example client's, shorter
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 3, "seed": 42,
     "detokenize": True, "repetition_penalty": 1.1},
    {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 16, "seed": 42,
     "detokenize": True, "repetition_penalty": 1.05},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42,
     "detokenize": True, "repetition_penalty": 1.1},
]  # fmt: skip


def test_sampling_params_list_sets_every_stage(server):
    body = {"messages": MESSAGES, "sampling_params_list": VLLM_OMNI_LIST, "modalities": None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text, speech = r.json()["choices"]
    assert r.json()["usage"]["completion_tokens"] == 3 and speech["message"]["audio"]["data"]
    again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert again["choices"][1]["message"]["audio"]["data"] == speech["message"]["audio"]["data"]


@pytest.mark.parametrize(
    ("entries", "field", "words"),
    [
        (VLLM_OMNI_LIST + [{}], "sampling_params_list", "Expected 3 sampling params, got 4"),
        ([{}, {"bogus": 1}], "sampling_params_list.1.bogus", "unknown"),
        ([{"detokenize": False}], "sampling_params_list.0.detokenize", "not implemented"),
        ([{}, {"temperature": -1}], "sampling_params_list.1.temperature", ">= 0"),
        ([{}, {}, {"num_steps": 1}], "sampling_params_list.2.num_steps", "[2, 100]"),
        ([{"max_tokens": 3}], "sampling_params_list.0.max_tokens", "differs"),
    ],
)
def test_bad_sampling_params_lists_are_400_naming_the_entry(server, entries, field, words):
    body = {"messages": MESSAGES, "sampling_params_list": entries, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and words in r.json()["error"]["message"]


def test_speaker_names_the_voice_in_any_case(server):
    body = {"messages": MESSAGES, **QUIET, **EXTRA, "modalities": ["audio"]}
    voices = [
        httpx.post(server.url + "/v1/chat/completions", json={**body, "speaker": s}, timeout=120)
        for s in ("Chelsie", "CHELSIE", "ethan")
    ]
    data = [v.json()["choices"][0]["message"]["audio"]["data"] for v in voices]
    assert data[0] == data[1] != data[2]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "speaker": "Nobody"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speaker", r.text


@pytest.mark.parametrize("audio_format", ["flac", "mp3", "opus"])
def test_compressed_speech_formats_decode_to_the_same_speech(server, audio_format):
    import io

    import numpy as np
    import soundfile

    body = {"messages": MESSAGES, **SPEAK, **EXTRA}
    wav = speak(server)["audio"]["data"]
    body["audio"] = {"voice": "Chelsie", "format": audio_format}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])), dtype="int16")  # fmt: skip
    reference = np.frombuffer(wav_of(wav)[2], dtype="<i2")
    assert rate == 24000
    if audio_format == "flac":  # lossless
        assert np.array_equal(samples, reference)
    else:
        assert abs(len(samples) - len(reference)) < rate // 10


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    import uuid

    body = {"messages": [{"role": "user", "content": f"Remember {uuid.uuid4().hex}"}]}
    body.update(modalities=["text"], max_tokens=2)
    first, second = (
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
        for _ in range(2)
    )
    assert second["prompt_tokens"] == first["prompt_tokens"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > first["prompt_tokens_details"]["cached_tokens"] and cached % 16 == 0


def test_a_batch_of_conversations_speaks_each_as_alone(server):
    """vLLM-Omni's /v1/chat/completions/batch: one choice per conversation, text and speech
    in one message, each as the same request alone."""
    body = {"messages": [MESSAGES, [{"role": "user", "content": "Hi"}]], **QUIET, **EXTRA}
    r = httpx.post(server.url + "/v1/chat/completions/batch", json=body, timeout=120)
    assert r.status_code == 200, r.text
    first, second = r.json()["choices"]
    alone = httpx.post(
        server.url + "/v1/chat/completions", json={**body, "messages": MESSAGES}, timeout=120
    ).json()["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["message"]["content"] == alone[0]["message"]["content"]
    assert wav_of(first["message"]["audio"]["data"]) == wav_of(alone[1]["message"]["audio"]["data"])
    assert second["message"]["content"] is not None and second["message"]["audio"]["data"]
