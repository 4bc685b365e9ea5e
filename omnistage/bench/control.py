"""Sleep/wake through the whole stack (AsyncOmni → stage process → arena), against the
alternative an operator has without sleep mode: stopping the stage and starting it again.

For each pipeline and level: end-to-end sleep and wake latency, memory really freed (from
the ACK), and time to the first generated token after the wake; the baseline is a cold
start of the same pipeline (process spawn, imports, model load) to its first token.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from omnistage.bench.report import write_results
from omnistage.engine.async_omni import AsyncOmni
from omnistage.pipelines import load_pipeline

COLUMNS = [
    "pipeline",
    "level",
    "sleep_ms",
    "wake_ms",
    "first_token_after_wake_ms",
    "freed_mib",
    "cold_start_ms",
    "wake_speedup_vs_cold_start",
]
SAMPLING = {"temperature": 0.0, "max_tokens": 1}


async def _first_token_ms(engine: AsyncOmni) -> float:
    start = time.perf_counter()
    async for _ in engine.generate("warm up", SAMPLING, ["text"]):
        break
    return (time.perf_counter() - start) * 1e3


def _cold_start_ms(name: str, device: str) -> float:
    start = time.perf_counter()
    engine = AsyncOmni.from_pipeline(name, device=device, enable_sleep_mode=True)
    try:
        asyncio.run(_first_token_ms(engine))
    finally:
        engine.shutdown()
    return (time.perf_counter() - start) * 1e3


async def _cycle(engine: AsyncOmni, level: int) -> dict[str, float]:
    start = time.perf_counter()
    acks = await engine.sleep([0], level=level)
    slept = time.perf_counter()
    await engine.wake_up([0])
    await engine.resume_generation([0])
    woke = time.perf_counter()
    first = await _first_token_ms(engine)
    return {
        "sleep_ms": (slept - start) * 1e3,
        "wake_ms": (woke - slept) * 1e3,
        "first_token_after_wake_ms": first,
        "freed_mib": acks[0]["freed_bytes"] / 2**20,
    }


def bench_pipeline(name: str, device: str, repeats: int) -> list[dict[str, Any]]:
    load_pipeline(name, device=device)  # build the models outside the timings
    cold = statistics.median(_cold_start_ms(name, device) for _ in range(2))
    engine = AsyncOmni.from_pipeline(name, device=device, enable_sleep_mode=True)
    rows = []
    try:

        async def run() -> None:
            await _first_token_ms(engine)
            for level in (1, 2):
                cycles = [await _cycle(engine, level) for _ in range(repeats)]
                row: dict[str, Any] = {"pipeline": name, "level": level, "cold_start_ms": cold}
                for key in cycles[0]:
                    row[key] = statistics.median(c[key] for c in cycles)
                row["wake_speedup_vs_cold_start"] = cold / (
                    row["wake_ms"] + row["first_token_after_wake_ms"]
                )
                rows.append(row)

        asyncio.run(run())
    finally:
        engine.shutdown()
    return rows


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: tuple[str, ...] = ("tiny-chat", "bench"),
    repeats: int = 3,
) -> str:
    rows = [row for name in pipelines for row in bench_pipeline(name, device, repeats)]
    return write_results(out_dir, f"control-{device.replace(':', '')}", rows, COLUMNS)
