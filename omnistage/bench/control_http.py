"""The control plane as an operator meets it: sleep and wake over HTTP on a running server.

``omnistage serve --pipeline tiny-omni --enable-sleep-mode`` in a process of its own; stage 0,
``cycles`` times per level: ``POST /v1/omni/sleep`` → ``POST /v1/omni/wakeup`` (which resumes
the stage), then a streamed 4-token chat whose first content chunk is the *first token after
wake*, then, after the stage idled as long as that sleep and wake took, the same chat again:
the *warm first token* of that cycle (nothing slept in between). The idle wait matters: a
request right behind another finds the CPU's caches and the stage's compute threads busy and
answers 5-15 % faster than one after a few milliseconds of idleness, wake or no wake (measured
in-process: after 5-20 ms idle, a warm first token took as long as one after a wake). Per level, p50 and p90 of:

- ``sleep_ms``, ``wake_ms``: each call's round trip as the client sees it;
- ``round_trip_ms``: sleep + wake;
- ``first_token_after_wake_ms`` and ``warm_first_token_ms``, and their ratio
  ``after_wake_vs_warm`` (p50 over p50; 1.0 means a wake leaves nothing to fault in).

The server runs without prefix caching: a sleep discards the KV cache and, by contract, the
prefixes cached in it, so with caching on the warm chat (its prompt cached by the chat before)
would be timed against an uncached one, measuring the prefix cache instead of the wake.

One keep-alive HTTP connection, as a control loop would hold. The whole run is a benchmark,
never a test: it writes ``control-http.json`` and a Markdown table.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import httpx

from omnistage.bench.report import write_results
from omnistage.bench.served import Served

COLUMNS = [
    "pipeline",
    "stage",
    "level",
    "cycles",
    "sleep_p50_ms",
    "sleep_p90_ms",
    "wake_p50_ms",
    "wake_p90_ms",
    "round_trip_p50_ms",
    "round_trip_p90_ms",
    "first_token_after_wake_p50_ms",
    "warm_first_token_p50_ms",
    "after_wake_vs_warm",
]
CHAT = {"max_tokens": 4, "temperature": 0.0, "stream": True, "modalities": ["text"]}


def served_pipeline(pipeline: str, device: str) -> Served:
    """``omnistage serve --pipeline NAME --enable-sleep-mode``, prefix caching off (see above)."""
    return Served(
        "--pipeline", pipeline, "--enable-sleep-mode", "--device", device,
        "--disable-log-requests", "--no-enable-prefix-caching",
    )  # fmt: skip


def _post_ms(client: httpx.Client, path: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    reply = client.post(path, json=body)
    elapsed = (time.perf_counter() - start) * 1e3
    data = reply.json()
    if reply.status_code != 200 or data.get("status") != "SUCCESS":
        raise RuntimeError(f"POST {path} {body}: {reply.status_code} {data}")
    return elapsed


def first_token_ms(client: httpx.Client, text: str = "first token") -> float:
    """A streamed chat's time to its first content chunk (the rest is read, not timed)."""
    body = {"messages": [{"role": "user", "content": text}], **CHAT}
    start = time.perf_counter()
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"chat: {reply.status_code} {reply.read()!r}")
        for line in reply.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = (time.perf_counter() - start) * 1e3
    if first is None:
        raise RuntimeError("the chat streamed no content")
    return first


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cycle_rows(client: httpx.Client, pipeline: str, level: int, cycles: int) -> dict[str, Any]:
    """``cycles`` sleep → wake cycles of stage 0 (the stage a chat starts at)."""
    print(f"[bench] {pipeline}: {cycles} sleep/wake cycles of stage 0 at level {level}",
          flush=True)  # fmt: skip
    sleeps, wakes, trips, after, warm = [], [], [], [], []
    for _ in range(cycles):
        sleep_ms = _post_ms(client, "/v1/omni/sleep", {"stage_ids": [0], "level": level})
        wake_ms = _post_ms(client, "/v1/omni/wakeup", {"stage_ids": [0]})
        after.append(first_token_ms(client))
        time.sleep((sleep_ms + wake_ms) / 1e3)  # as idle as the stage was before that chat
        warm.append(first_token_ms(client))
        sleeps.append(sleep_ms)
        wakes.append(wake_ms)
        trips.append(sleep_ms + wake_ms)
    stages = client.get("/v1/omni/stages").json().get("stages") or [{}]
    stage = f"0 ({stages[0].get('name') or stages[0].get('kind') or '?'})"
    row: dict[str, Any] = {"pipeline": pipeline, "stage": stage, "level": level, "cycles": cycles}
    for name, values in (("sleep", sleeps), ("wake", wakes), ("round_trip", trips)):
        row[f"{name}_p50_ms"] = statistics.median(values)
        row[f"{name}_p90_ms"] = _percentile(values, 0.9)
    row["first_token_after_wake_p50_ms"] = statistics.median(after)
    row["first_token_after_wake_p90_ms"] = _percentile(after, 0.9)
    row["warm_first_token_p50_ms"] = statistics.median(warm)
    row["warm_first_token_p90_ms"] = _percentile(warm, 0.9)
    row["after_wake_vs_warm"] = (
        row["first_token_after_wake_p50_ms"] / row["warm_first_token_p50_ms"]
    )
    return row


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: tuple[str, ...] = ("tiny-omni",),
    repeats: int = 30,
) -> str:
    """``repeats`` sleep → wake cycles per level and pipeline (30 by default)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rows = []
    for pipeline in pipelines:
        print(f"[bench] starting omnistage serve --pipeline {pipeline}", flush=True)
        with (
            served_pipeline(pipeline, device) as served,
            httpx.Client(base_url=served.url, timeout=120) as client,
        ):
            for _ in range(3):  # warm-up: first requests, first sleeps of each level
                first_token_ms(client)
            for level in (1, 2):
                _post_ms(client, "/v1/omni/sleep", {"stage_ids": [0], "level": level})
                _post_ms(client, "/v1/omni/wakeup", {"stage_ids": [0]})
                first_token_ms(client)
            for level in (1, 2):
                rows.append(cycle_rows(client, pipeline, level, repeats))
    return write_results(out_dir, f"control-http-{device.replace(':', '')}", rows, COLUMNS)
