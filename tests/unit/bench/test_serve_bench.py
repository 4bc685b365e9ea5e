"""``omnistage bench serve`` without a server: the arrival schedule, the statistics, the
stream accounting (vLLM's and omnistage's chunk shapes, audio, errors), the prompt files, the
request bodies, and the flags' checks."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import statistics
import wave

import httpx
import numpy as np
import pytest

from omnistage import cli
from omnistage.bench import serve
from omnistage.bench.serve_client import Progress, RequestResult, StreamError, send, take_event
from omnistage.bench.serve_stats import percentile, summarize, tables


def test_percentiles_interpolate_as_numpy_does():
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.45]
    for q in (1, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_infinite_rate_sends_everything_at_once():
    assert serve.arrival_times(5, math.inf) == [0.0] * 5


def test_poisson_arrivals_are_seeded_and_end_at_n_over_rate():
    times = serve.arrival_times(2000, 50.0, seed=3)
    assert times == serve.arrival_times(2000, 50.0, seed=3)
    assert times != serve.arrival_times(2000, 50.0, seed=4)
    assert times[-1] == pytest.approx(2000 / 50.0) and times == sorted(times)
    gaps = np.diff([0.0, *times])
    # exponential gaps: coefficient of variation 1; a gamma of shape 4: 1/2
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)
    steady = np.diff([0.0, *serve.arrival_times(2000, 50.0, burstiness=4.0, seed=3)])
    assert steady.std() / steady.mean() == pytest.approx(0.5, abs=0.05)
    even = serve.arrival_times(4, 2.0, burstiness=math.inf)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])


def chunk(delta: dict | None = None, usage: dict | None = None, **choice: object) -> dict:
    choices = [] if delta is None and not choice else [{"index": 0, "delta": delta, **choice}]
    return {"choices": choices, **({"usage": usage} if usage else {})}


def test_a_chat_stream_is_timed_by_its_content_deltas():
    r = RequestResult()
    take_event(r, chunk({"role": "assistant", "content": ""}), 0.1)  # no token yet
    for t, text in ((0.5, "Hel"), (0.7, "lo"), (1.0, " you")):
        take_event(r, chunk({"content": text}), t)
    take_event(r, chunk({}, finish_reason="length"), 1.1)
    assert (r.ttft, r.itl, r.text, r.ttfa) == (0.5, pytest.approx([0.2, 0.3]), "Hello you", None)
    assert r.output_tokens == 3 and r.tpot == pytest.approx(0.25)  # counted from the stream
    take_event(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}, 1.2)
    assert (r.prompt_tokens, r.output_tokens) == (9, 5) and r.tpot == pytest.approx(0.125)


def wav_bytes(frames: int, rate: int = 24000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(b"\0\0" * frames)
    return out.getvalue()


def test_audio_is_timed_by_its_first_data_chunk():
    data = base64.b64encode(wav_bytes(12000)).decode()
    r = RequestResult()
    take_event(r, chunk({"audio": {"id": "a", "transcript": "hi"}}), 0.2)  # no data yet
    take_event(r, chunk({"audio": {"id": "a", "data": data[:8]}}), 0.4)
    take_event(r, chunk({"audio": {"id": "a", "data": data[8:]}}), 0.6)
    take_event(r, chunk({"audio": {"id": "a", "expires_at": 1}}), 0.7)
    assert r.ttfa == 0.4 and r.ttft is None
    assert r.audio_seconds("wav") == pytest.approx(0.5)
    r.audio.append(wav_bytes(24000))  # a second WAV in the same answer
    assert r.audio_seconds("wav") == pytest.approx(1.5)
    assert RequestResult(audio=[b"\0" * 4800]).audio_seconds("pcm16") == pytest.approx(0.1)
    streamed = bytearray(wav_bytes(0))  # a streamed WAV: its sizes say "unknown"
    streamed[4:8] = streamed[40:44] = b"\xff\xff\xff\xff"
    r = RequestResult(audio=[bytes(streamed), b"\0\0" * 6000, b"\0\0" * 6000])
    assert r.audio_seconds("wav") == pytest.approx(0.5)
    assert RequestResult(audio=[b"not a wav"]).audio_seconds("wav") is None


@pytest.mark.parametrize(
    "event",
    [{"error": {"message": "stage restarting", "code": "stage_restarting"}}, {"object": "error", "message": "boom"}],
)  # fmt: skip
def test_an_error_in_the_stream_fails_the_request(event):
    with pytest.raises(StreamError, match="stage restarting|boom"):
        take_event(RequestResult(), event, 0.1)


def sse(*events: dict, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return ": ping\n\n".join(lines).encode()


def run_send(handler) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://x/v1/chat/completions", {}, {}, 0.0)

    return asyncio.run(go())


def test_send_reads_vllms_stream_and_counts_tokens_without_usage():
    # vLLM's chat stream: a role chunk, content chunks, a finish chunk (no usage asked here)
    body = sse(
        chunk({"role": "assistant", "content": ""}),
        *(chunk({"content": w}) for w in ("a", "b", "c", "d")),
        chunk({"content": ""}, finish_reason="stop"),
    )
    r = run_send(lambda request: httpx.Response(200, content=body))
    assert r.success and r.error == "" and r.text == "abcd"
    assert r.completion_tokens is None and r.output_tokens == 4 and len(r.itl) == 3
    assert r.latency >= r.ttft >= 0  # type: ignore[operator]


def test_send_names_http_errors_and_bad_events():
    bad = {"error": {"message": "max_tokens: must be at least 1", "type": "invalid"}}
    r = run_send(lambda request: httpx.Response(400, json=bad))
    assert not r.success and r.error == "HTTP 400: max_tokens: must be at least 1"
    r = run_send(lambda request: httpx.Response(200, content=b"data: {not json\n\n"))
    assert not r.success and r.error.startswith("JSONDecodeError")

    def refuse(request):
        raise httpx.ConnectError("refused")

    assert run_send(refuse).error == "ConnectError: refused"


def ok(ttft: float, itl: list[float], latency: float, tokens: int | None) -> RequestResult:
    last = ttft + sum(itl)
    return RequestResult(True, start=0.0, latency=latency, ttft=ttft, last_token=last, itl=itl,
                         content_deltas=len(itl) + 1, completion_tokens=tokens, prompt_tokens=10)  # fmt: skip


def test_the_summary_counts_failures_throughput_and_percentiles():
    results = [
        ok(0.1, [0.05, 0.05], 0.3, 3),
        ok(0.3, [0.1], 0.5, None),  # no usage: 2 tokens counted from the stream
        RequestResult(error="HTTP 503: busy"),
        RequestResult(error="HTTP 503: busy"),
        RequestResult(error="ReadTimeout"),
    ]
    s = summarize(results, 2.0, ("ttft", "itl", "e2el", "ttfa"), (50, 99))
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 3, 5)
    assert s["total_input_tokens"] == 20 and s["request_throughput"] == 1.0
    assert s["output_throughput"] == 2.5 and s["total_token_throughput"] == 12.5
    assert s["errors"] == ["2 x HTTP 503: busy", "1 x ReadTimeout"]
    assert s["output_tokens_from"] == "usage where reported, else stream"
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["p50_e2el_ms"] == pytest.approx(400)
    assert s["n_itl"] == 3 and s["median_itl_ms"] == pytest.approx(50)
    assert s["n_ttfa"] == 0 and s["mean_ttfa_ms"] is None
    run = {"backend": "openai-chat", "model": "m", "request_rate": "inf", "max_concurrency": 2}
    text = tables(s, run, ("ttft", "itl", "e2el", "ttfa"), (50, 99))
    assert "| ttfa | 0 | - | - | - | - |" in text and "- `p99_ms`: 99th percentile (ms)" in text
    assert "- `itl`: inter-token latency" in text and "counted from the stream" in text
    assert "- 2 x HTTP 503: busy" in text and text.count("Legend:") == 2


def test_prompt_files_are_json_lines_a_user_can_write(tmp_path):
    path = tmp_path / "p.jsonl"
    messages = [{"role": "user", "content": "hi"}]
    lines = [
        '"plain"',
        '{"prompt": "two", "output_len": 3}',
        "",
        json.dumps({"messages": messages}),
    ]
    path.write_text("\n".join(lines) + "\n")
    samples = serve.file_samples(str(path), 5, 7)
    assert [(s.prompt, s.output_len) for s in samples[:3]] == [("plain", 7), ("two", 3), (None, 7)]
    assert samples[2].messages == messages and samples[3:] == samples[:2]  # used again
    path.write_text('"ok"\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl, line 2"):
        serve.file_samples(str(path), 2, 7)
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match="output_len must be a positive integer"):
        serve.file_samples(str(path), 1, 7)


def test_random_prompts_are_seeded_and_vary_within_the_ratio():
    config = serve.ServeBenchConfig(num_prompts=50, random_input_len=20, random_range_ratio=0.5)
    samples = serve.random_samples(config)
    assert samples == serve.random_samples(config)
    lengths = [len(s.prompt.split()) for s in samples]  # type: ignore[union-attr]
    assert min(lengths) >= 10 and max(lengths) <= 30 and statistics.pstdev(lengths) > 0
    assert {s.output_len for s in samples} <= set(range(16, 49))


def test_request_bodies_stream_with_usage_and_ask_for_audio_when_told():
    sample = serve.Sample(5, prompt="hi")
    chat = serve.payload(serve.ServeBenchConfig(ignore_eos=True), "m", sample)
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["ignore_eos"]
    assert chat["max_completion_tokens"] == 5 and chat["modalities"] == ["text"]
    config = serve.ServeBenchConfig(
        modalities=("text", "audio"), audio_voice="Chelsie", extra_body={"seed": 1}
    )
    body = serve.payload(config, "m", sample)
    assert body["modalities"] == ["text", "audio"] and body["seed"] == 1
    assert body["audio"] == {"format": "wav", "voice": "Chelsie"}
    assert config.metrics == ("ttft", "tpot", "itl", "ttfa", "e2el")
    completion = serve.ServeBenchConfig(backend="openai", base_url="http://h:1/")
    assert serve.payload(completion, "m", sample)["prompt"] == "hi"
    assert completion.url == "http://h:1/v1/completions"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["--modalities", "text,video"], "--modalities takes some of text,audio"),
        (["--backend", "openai", "--modalities", "text,audio"], "needs --backend openai-chat"),
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--percentile-metrics", "ttft,tbt"], "--percentile-metrics takes some of"),
        (["--metric-percentiles", "0"], "--metric-percentiles takes percentiles"),
        (["--extra-body", "[1]"], "--extra-body takes a JSON object"),
        (["--dataset", "/no/such/file.jsonl"], "--dataset is 'random' or an existing JSONL"),
    ],
)
def test_bad_flags_exit_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", "serve", *argv])


def test_the_progress_bar_writes_a_line_per_tenth_off_a_terminal():
    out = io.StringIO()
    bar = Progress(20, stream=out)
    for i in range(20):
        bar.update(success=i != 3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("[" + "#" * Progress.WIDTH + "] 20/20")
    assert "1 failed" in lines[-1]
