"""What robustness costs and buys, through a real ``omnistage serve`` over HTTP.

- Fairness: the latency of a 4-token chat alone, beside 64 concurrent chat clients, and
  beside those clients plus hostile requests (a 4096x4096 image, a 50 MB body — both refused
  up front); beside one completion whose n = 32 long samples hold every sequence slot (fair
  share); and of ``GET /health`` while a ~4 MB chat is sent (refused by its length before
  any tokenizing: the event loop never stalls). The baseline is the same chat on an idle
  server, in the same run.
- Restart: a stage killed with SIGKILL, until the server has it back and until it answers
  again, against a cold start of the whole server to its first answer.
- Media and speech under keep sleeps, on the tiny Qwen2.5-Omni pipeline
  (``robustness_media.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from typing import Any

import httpx

from omnistage.bench import robustness_media
from omnistage.bench.report import write_results
from omnistage.bench.served import Served

COLUMNS = ["case", "p50_ms", "p90_ms", "max_ms", "vs_idle", "statuses"]
RESTART_COLUMNS = ["stage", "back_ms", "first_answer_ms", "cold_start_ms", "vs_cold_start"]
NUM_CLIENTS = 64
PROBES = 20
# Text only: a chat without modalities asks for every output the pipeline makes.
CHAT = {"max_tokens": 4, "temperature": 0.0, "modalities": ["text"]}


class Server(Served):
    """``omnistage serve`` on a free port, stopped on exit."""

    def stages(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/v1/omni/stages", timeout=30).json()["stages"])

    def chat_ms(self, text: str = "how long?") -> float:
        start = time.perf_counter()
        body = {"messages": [{"role": "user", "content": text}], **CHAT}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        return (time.perf_counter() - start) * 1e3


async def _probe(url: str, background: bool, hostile: bool) -> tuple[list[float], list[int]]:
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def chat(text: str, max_tokens: int) -> float:
            body = {"messages": [{"role": "user", "content": text}], **CHAT}
            body["max_tokens"] = max_tokens
            start = time.perf_counter()
            headers = {"Connection": "close"}
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()
            return (time.perf_counter() - start) * 1e3

        async def keep_talking(i: int) -> None:
            while not done.is_set():
                await chat(f"client {i}", 16)

        count = NUM_CLIENTS if background else 0
        workers = [asyncio.ensure_future(keep_talking(i)) for i in range(count)]
        await asyncio.sleep(1.0 if background else 0)
        statuses: list[int] = []
        if hostile:
            huge = {"prompt": "a huge cat", "size": "4096x4096", "num_inference_steps": 200}
            body = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000_000}]})
            replies = await asyncio.gather(
                client.post(url + "/v1/images/generations", json=huge),
                client.post(url + "/v1/chat/completions", content=body.encode()),
            )
            statuses = [r.status_code for r in replies]
        latencies = [await chat(f"probe {i}", 4) for i in range(PROBES)]
        done.set()
        await asyncio.gather(*workers)
    return latencies, statuses


async def _beside_big(url: str) -> tuple[list[float], list[int]]:
    """A 4-token chat, 5 times, while one completion of n = 32 x 400 tokens runs."""
    async with httpx.AsyncClient(timeout=300) as client:
        body = {"prompt": "a long story", "n": 32, "max_tokens": 400, "ignore_eos": True}
        big = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
        await asyncio.sleep(1.0)  # its samples hold every sequence slot
        latencies: list[float] = []
        for i in range(5):
            start = time.perf_counter()
            chat = {"messages": [{"role": "user", "content": f"probe {i}"}], **CHAT}
            (await client.post(url + "/v1/chat/completions", json=chat)).raise_for_status()
            latencies.append((time.perf_counter() - start) * 1e3)
        return latencies, [(await big).status_code]


async def _health_during_big_prompt(url: str) -> tuple[list[float], list[int]]:
    """``GET /health`` round trips while a ~4 MB chat (under the body limit) is sent."""
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"messages": [{"role": "user", "content": "word " * 780_000}], **CHAT}
        big = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=body))
        latencies: list[float] = []
        while not big.done() or not latencies:
            start = time.perf_counter()
            (await client.get(url + "/health")).raise_for_status()
            latencies.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.005)
        return latencies, [(await big).status_code]


def _row(case: str, latencies: list[float], idle_p50: float, statuses: list[int]) -> dict:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    return {
        "case": case,
        "p50_ms": p50,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "max_ms": ordered[-1],
        "vs_idle": p50 / idle_p50,
        "statuses": ",".join(map(str, statuses)) or "-",
    }


def bench_fairness(server: Server) -> list[dict[str, Any]]:
    idle, _ = asyncio.run(_probe(server.url, background=False, hostile=False))
    idle_p50 = statistics.median(idle)
    busy, _ = asyncio.run(_probe(server.url, background=True, hostile=False))
    hostile, statuses = asyncio.run(_probe(server.url, background=True, hostile=True))
    beside_big, big_status = asyncio.run(_beside_big(server.url))
    health, prompt_status = asyncio.run(_health_during_big_prompt(server.url))
    return [
        _row("idle server", idle, idle_p50, []),
        _row(f"beside {NUM_CLIENTS} clients", busy, idle_p50, []),
        _row(f"beside {NUM_CLIENTS} clients + 4096x4096 image + 50 MB body", hostile, idle_p50,
             statuses),
        _row("beside one completion of n=32 x 400 tokens", beside_big, idle_p50, big_status),
        _row("GET /health while a 4 MB chat is sent", health, idle_p50, prompt_status),
    ]  # fmt: skip


def bench_restart(server: Server, cold_start_ms: float) -> list[dict[str, Any]]:
    rows = []
    for stage in server.stages():
        sid, restarts = stage["stage_id"], stage["restarts"]
        os.kill(stage["pid"], signal.SIGKILL)
        killed = time.perf_counter()
        while server.stages()[sid]["restarts"] == restarts:
            time.sleep(0.01)
        back = (time.perf_counter() - killed) * 1e3
        extra = {} if sid == 0 else {"modalities": ["text", "image"], "num_inference_steps": 2}
        start = time.perf_counter()
        body = {"messages": [{"role": "user", "content": "back?"}], **CHAT, **extra}
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
        first = back + (time.perf_counter() - start) * 1e3
        rows.append(
            {
                "stage": f"{sid} ({stage['name']})",
                "back_ms": back,
                "first_answer_ms": first,
                "cold_start_ms": cold_start_ms,
                "vs_cold_start": cold_start_ms / first,
            }
        )
    return rows


def run(out_dir: str, device: str = "cpu") -> str:
    args = ("--pipeline", "tiny-omni", "--device", device, "--max-stage-restarts", "5")
    start = time.perf_counter()
    with Server(*args) as server:
        server.chat_ms()
        cold_start_ms = (time.perf_counter() - start) * 1e3
        fairness = bench_fairness(server)
        restart = bench_restart(server, cold_start_ms)
    with Server(
        "--pipeline", "tiny-qwen2.5-omni", "--device", device, "--enable-sleep-mode"
    ) as omni:
        media = robustness_media.bench_media(omni)
        speech = robustness_media.bench_speech(omni)
    budget = ("--max-media-decoded-bytes-in-flight", robustness_media.BUDGET)
    with Server("--pipeline", "tiny-qwen2.5-omni", "--device", device, *budget) as omni:
        media += robustness_media.bench_media(omni, budgeted=True)
    name = device.replace(":", "")
    tables = [
        write_results(out_dir, f"fairness-{name}", fairness, COLUMNS),
        write_results(out_dir, f"restart-{name}", restart, RESTART_COLUMNS),
        write_results(out_dir, f"media-{name}", media, robustness_media.MEDIA_COLUMNS),
        write_results(out_dir, f"speech-sleeps-{name}", speech, robustness_media.SPEECH_COLUMNS),
    ]
    return "\n\n".join(tables)
