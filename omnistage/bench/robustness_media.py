"""Robustness of media in prompts and of streamed speech, through a real ``omnistage serve``
of the tiny Qwen2.5-Omni pipeline (it hears audio and video, and speaks).

- Media: the API process's peak RSS and a 4-token text chat's latency while 8 requests at
  once carry media that are small on the wire and huge decoded — a FLAC of 600 s at 48 kHz
  (about 100 KB; 115 MB as float32), a 4K video of 60 s (720 MB at 2 fps) — both refused
  from their headers before any decoding; and beside 8 ordinary 10 s WAVs that are served.
  The baseline is the same chat on the idle server, and its RSS, in the same run.
- Speech under keep sleeps: streamed speech requests while the talker is put to sleep with
  mode ``keep`` and woken at random moments (seeded): how many were served, refused (503,
  they came while it slept), and left unfinished after a bound (a hang), against the same
  requests with no sleep.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from omnistage.bench.served import Served

MEDIA_COLUMNS = ["case", "statuses", "api_rss_peak_mb", "vs_idle_rss", "chat_p50_ms",
                 "chat_max_ms", "vs_idle_chat"]  # fmt: skip
SPEECH_COLUMNS = ["case", "requests", "served", "refused_503", "unfinished", "p50_ms",
                  "max_ms", "vs_no_sleeps"]  # fmt: skip
TEXT = {"max_tokens": 4, "temperature": 0.0, "modalities": ["text"]}
SPEECH = {
    "messages": [{"role": "user", "content": "Say something"}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Chelsie", "format": "pcm16"},
    "max_tokens": 6,
    "temperature": 0,
    "seed": 5,
    "stream": True,
    "talker_params": {"temperature": 0.9, "max_tokens": 24},
    "audio_params": {"num_steps": 2},
}
BOUND_S = 60.0  # a request not finished by then counts as unfinished


def flac_bomb() -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, np.zeros(600 * 48_000, dtype=np.int16), 48_000, format="FLAC")
    return out.getvalue()


def video_bomb() -> bytes:
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=1)
        stream.width, stream.height, stream.pix_fmt = 3840, 2160, "yuv420p"
        black = av.VideoFrame.from_ndarray(np.zeros((2160, 3840, 3), np.uint8), format="rgb24")
        for _ in range(60):
            container.mux(stream.encode(black))
        container.mux(stream.encode())
    return out.getvalue()


def wav(seconds: float = 10.0) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    t = np.arange(int(seconds * 16_000)) / 16_000
    sf.write(out, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16_000, format="WAV")
    return out.getvalue()


def _audio_chat(raw: bytes, fmt: str) -> dict[str, Any]:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(),
                                                   "format": fmt}}  # fmt: skip
    return {"messages": [{"role": "user", "content": [part]}], **TEXT, "max_tokens": 1}


def _video_chat(raw: bytes) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    part = {"type": "video_url", "video_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [part]}], **TEXT, "max_tokens": 1}


class PeakRSS:
    """The highest RSS of a process, sampled every 5 ms on a thread while inside."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _chats_beside(url: str, bodies: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """4-token chats, one after another, while ``bodies`` are posted at once (10 at least)."""
    async with httpx.AsyncClient(timeout=300) as client:
        heavy = asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
        latencies: list[float] = []
        while not heavy.done() or len(latencies) < 10:
            start = time.perf_counter()
            body = {"messages": [{"role": "user", "content": f"probe {len(latencies)}"}], **TEXT}
            (await client.post(url + "/v1/chat/completions", json=body)).raise_for_status()
            latencies.append((time.perf_counter() - start) * 1e3)
        return latencies, [r.status_code for r in await heavy]


BUDGET = "256MiB"  # --max-media-decoded-bytes-in-flight of the second server


def bench_media(server: Served, budgeted: bool = False) -> list[dict[str, Any]]:
    """The cases on ``server``; ``budgeted``: the server holds at most ``BUDGET`` of decoded
    media at once (two of the FLACs), and only the idle and FLAC cases run."""
    flacs = [_audio_chat(flac_bomb(), "flac")] * 8
    cases = [
        ("idle server", []),
        ("8 FLACs of 600 s at 48 kHz at once", flacs),
        ("8 videos of 60 s in 4K at once", [_video_chat(video_bomb())] * 8),
        ("8 WAVs of 10 s at 16 kHz at once (served)", [_audio_chat(wav(), "wav")] * 8),
    ]
    if budgeted:
        cases = [
            (f"idle server, decoded media at most {BUDGET}", []),
            (f"8 FLACs of 600 s at 48 kHz at once, at most {BUDGET}", flacs),
        ]
    rows: list[dict[str, Any]] = []
    for case, bodies in cases:
        with PeakRSS(server.process.pid) as rss:
            latencies, statuses = asyncio.run(_chats_beside(server.url, bodies))
        p50 = statistics.median(latencies)
        idle = rows[0] if rows else {"api_rss_peak_mb": rss.peak / 2**20, "chat_p50_ms": p50}
        rows.append(
            {
                "case": case,
                "statuses": ",".join(map(str, sorted(set(statuses)))) or "-",
                "api_rss_peak_mb": rss.peak / 2**20,
                "vs_idle_rss": rss.peak / 2**20 / idle["api_rss_peak_mb"],
                "chat_p50_ms": p50,
                "chat_max_ms": max(latencies),
                "vs_idle_chat": p50 / idle["chat_p50_ms"],
            }
        )
    return rows


async def _speak(client: httpx.AsyncClient, url: str) -> tuple[str, float]:
    """One streamed speech request: ("served" | "refused" | "error", its milliseconds)."""
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=SPEECH) as r:
        if r.status_code == 503:
            return "refused", (time.perf_counter() - start) * 1e3
        ended = False
        async for line in r.aiter_lines():
            ended = ended or line == "data: [DONE]" or '"error"' in line
        outcome = "served" if r.status_code == 200 and ended else "error"
        return outcome, (time.perf_counter() - start) * 1e3


async def _speech_run(url: str, sleeps: bool, seed: int = 42) -> dict[str, Any]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=BOUND_S * 2) as client:
        runs: list[asyncio.Task[tuple[str, float]]] = []
        for _ in range(8):
            runs += [asyncio.ensure_future(_speak(client, url)) for _ in range(2)]
            await asyncio.sleep(rng.uniform(0.0, 0.06))
            if sleeps:
                body = {"stage_ids": [1], "level": rng.choice([1, 2]), "mode": "keep"}
                (await client.post(url + "/v1/omni/sleep", json=body)).raise_for_status()
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                wake = {"stage_ids": [1]}
                (await client.post(url + "/v1/omni/wakeup", json=wake)).raise_for_status()
        done, late = await asyncio.wait(runs, timeout=BOUND_S)
        for task in late:
            task.cancel()
    results = [task.result() for task in done]
    served = [ms for outcome, ms in results if outcome == "served"]
    return {
        "requests": len(runs),
        "served": len(served),
        "refused_503": sum(outcome == "refused" for outcome, _ in results),
        "unfinished": len(late) + sum(outcome == "error" for outcome, _ in results),
        "p50_ms": statistics.median(served) if served else float("nan"),
        "max_ms": max(served, default=float("nan")),
    }


def bench_speech(server: Served) -> list[dict[str, Any]]:
    calm = asyncio.run(_speech_run(server.url, sleeps=False))
    busy = asyncio.run(_speech_run(server.url, sleeps=True))
    return [
        {"case": "no sleeps", **calm, "vs_no_sleeps": 1.0},
        {"case": "talker slept (keep) and woken 8 times at random moments", **busy,
         "vs_no_sleeps": busy["p50_ms"] / calm["p50_ms"]},
    ]  # fmt: skip
