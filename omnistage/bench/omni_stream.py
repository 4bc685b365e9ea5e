"""Speech streamed while the talker speaks, measured as a client hears it: ``omnistage bench
serve`` (streamed chat requests with text and audio) against two ``omnistage serve`` processes
of the ``tiny-qwen2.5-omni`` pipeline — its code2wav edge streamed (the default) and whole
(``--no-stream``) — at concurrency 1 and 8, on the same prompts and seeds.

Columns: ``ttfa_ms`` (request sent → its first audio), ``e2e_ms`` (→ the stream's end),
``requests_per_s`` and its ratios to the same mode at concurrency 1 and to transformers'
``generate`` (one request after another, measured by ``bench omni``'s throughput table in the
same run: ``transformers_requests_per_s``); ``ttfa_vs_whole`` is the streamed time to first
audio over the whole-mode time to the whole audio (``e2e``) at the same concurrency;
``audio_as_alone``: of the prompts also sent at concurrency 1, those whose audio bytes are
the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from typing import Any

from omnistage.bench.report import write_results
from omnistage.bench.serve import ServeBenchConfig, bench
from omnistage.bench.served import Served

PIPELINE = "tiny-qwen2.5-omni"
MODES = {"streamed": (), "whole": ("--no-stream",)}
REQUESTS = {1: 4, 8: 16}  # requests per concurrency (the same seed: the first 4 are shared)
COLUMNS = ["mode", "concurrency", "requests", "ttfa_ms", "e2e_ms", "requests_per_s",
           "vs_concurrency_1", "vs_transformers", "ttfa_vs_whole", "audio_as_alone"]  # fmt: skip


def speech_load(
    url: str, concurrency: int, thinker_tokens: int, talker_tokens: int, num_steps: int
) -> ServeBenchConfig:
    """``REQUESTS[concurrency]`` seeded greedy speech requests (random 8-token prompts, the
    same in every run) ``concurrency`` at a time after one warm-up, pcm16 audio."""
    return ServeBenchConfig(
        base_url=url,
        num_prompts=REQUESTS[concurrency],
        max_concurrency=concurrency,
        modalities=("text", "audio"),
        audio_voice="Chelsie",
        audio_format="pcm16",
        random_input_len=8,
        random_output_len=thinker_tokens,
        extra_body={
            "seed": 7,
            "talker_params": {"temperature": 0.0, "max_tokens": talker_tokens},
            "audio_params": {"num_steps": num_steps},
        },
        seed=1,  # the same prompts in every run
        num_warmups=1,
        progress=False,
    )


def _config(url: str, concurrency: int, settings: Any) -> ServeBenchConfig:
    return speech_load(
        url,
        concurrency,
        settings.thinker_tokens,
        settings.stream_talker_tokens,
        settings.num_steps,
    )


def measure(settings: Any, device: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (mode, concurrency): the bench serve summary and each request's audio bytes."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for mode, flags in MODES.items():
        with Served("--pipeline", PIPELINE, "--device", device, *flags) as server:
            for concurrency in REQUESTS:
                summary, results = asyncio.run(bench(_config(server.url, concurrency, settings)))
                failed = [r.error for r in results if not r.success]
                if failed:
                    raise RuntimeError(f"{mode} x{concurrency}: {len(failed)} failed: {failed[0]}")
                audio = [b"".join(r.audio) for r in results]
                ttfa = [r.ttfa for r in results if r.ttfa is not None]
                e2e = [r.latency for r in results]
                runs[mode, concurrency] = {
                    "summary": summary,
                    "audio": audio,
                    "ttfa_ms": statistics.mean(ttfa) * 1e3,
                    "e2e_ms": statistics.mean(e2e) * 1e3,
                }
    return runs


def load_columns(
    run: dict[str, Any], alone: dict[str, Any], transformers_requests_per_s: float
) -> dict[str, Any]:
    """A run's requests, its times and rate, and the rate over ``alone``'s (the same mode at
    concurrency 1) and over transformers'."""
    rate = float(run["summary"]["request_throughput"])
    return {
        "requests": len(run["audio"]),
        "ttfa_ms": run["ttfa_ms"],
        "e2e_ms": run["e2e_ms"],
        "requests_per_s": rate,
        "vs_concurrency_1": rate / float(alone["summary"]["request_throughput"]),
        "vs_transformers": rate / transformers_requests_per_s,
    }


def rows(
    runs: dict[tuple[str, int], dict[str, Any]], transformers_requests_per_s: float
) -> list[dict[str, Any]]:
    out = []
    for (mode, concurrency), run in runs.items():
        base = runs[mode, 1]["audio"]  # the same prompts come first in every run
        same = sum(a == b for a, b in zip(run["audio"], base, strict=False))
        out.append(
            {
                "mode": mode,
                "concurrency": concurrency,
                **load_columns(run, runs[mode, 1], transformers_requests_per_s),
                "ttfa_vs_whole": run["ttfa_ms"] / runs["whole", concurrency]["e2e_ms"],
                "audio_as_alone": f"{same}/{len(base)}",
            }
        )
    return out


def run(out_dir: str, name: str, settings: Any, device: str, transformers: Any) -> str:
    """Write ``<name>-stream.{json,md}``; return the table. ``transformers``: ``bench omni``'s
    runner, timed here on the first 4 prompts with replies as long as the streamed ones."""
    long = dataclasses.replace(
        settings, talker_tokens=settings.stream_talker_tokens, prompts=settings.prompts[:4]
    )
    transformers.settings = long
    baseline = transformers.run()
    table = rows(measure(settings, device), len(long.prompts) / baseline.seconds)
    return write_results(out_dir, name + "-stream", table, COLUMNS)
