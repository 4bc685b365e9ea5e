"""Sleep/wake through the whole stack (AsyncOmni → stage process → arena), against the
alternative an operator has without sleep mode: stopping the stage and starting it again.

For each pipeline and level, medians over ``repeats`` cycles of sleep → wake → resume:

- ``sleep_ms``, ``wake_ms`` (wake + resume), end to end through the public ``AsyncOmni`` API;
- ``first_token_after_wake_ms``: a 1-token request right after the wake;
- ``freed_mib``: the sleep ACK's ``freed_bytes``, which the stage measures itself (device
  memory from ``torch.cuda.mem_get_info`` on CUDA, its RSS on the host);
- ``first_sleep_ms``: the first cycle's sleep (for level 1 the stage process's first sleep);
- ``restore_gbps``: the wake ACK's ``gbps`` (bytes restored over the stage's wake latency);
- level 2 only, the reload against its physical baseline (``read_baseline``): ``reload_gbps``
  (the wake ACK's: checkpoint bytes read over the reload's time) beside ``read_gbps`` (a plain
  one-stream read of the same page-cached files into resident memory), ``read_threads_gbps``
  (the same on the stage's threads) and ``fresh_read_gbps`` (on the stage's threads into
  freshly mapped memory, as a reload must), with ``reload_vs_read`` and
  ``reload_vs_fresh_read``;
- ``cuda_graph_recalled``: every wake ACK says the decode CUDA graphs were kept and replayed
  without capture (the AR engine captures them on CUDA only: always False on the host);
- ``same_output``: a greedy decode (16 tokens, temperature 0, eos ignored) after every wake
  gives the same token ids as before the first sleep;
- ``cold_start_ms``: the baseline, a fresh start of the same pipeline (process spawn,
  imports, model load, CUDA graph capture) to its first token; median of ``cold_starts``.

Results are written after each pipeline's cycles and again once its cold start is measured,
so a run cut short keeps what it finished.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from omnistage.bench.read_baseline import read_baselines
from omnistage.bench.report import write_results
from omnistage.engine.async_omni import AsyncOmni
from omnistage.engine.spawn import stage_threads
from omnistage.models.loader import checkpoint_files
from omnistage.pipelines import load_pipeline

COLUMNS = [
    "pipeline",
    "level",
    "sleep_ms",
    "first_sleep_ms",
    "wake_ms",
    "restore_gbps",
    "reload_gbps",
    "read_gbps",
    "read_threads_gbps",
    "fresh_read_gbps",
    "reload_vs_read",
    "reload_vs_fresh_read",
    "first_token_after_wake_ms",
    "freed_mib",
    "cuda_graph_recalled",
    "same_output",
    "cold_start_ms",
    "wake_speedup_vs_cold_start",
]
FIRST_TOKEN = {"temperature": 0.0, "max_tokens": 1}
DECODE_PROMPT = "Sleep well, wake up fast and say the same thing"
DECODE = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
TIMED_KEYS = (
    "sleep_ms",
    "wake_ms",
    "restore_gbps",
    "reload_gbps",
    "first_token_after_wake_ms",
    "freed_mib",
)
FLAG_KEYS = ("cuda_graph_recalled", "same_output")


class ControlBenchError(RuntimeError):
    """A sleep or wake did not succeed: there is nothing honest to report for it."""


async def _first_token_ms(engine: AsyncOmni) -> float:
    start = time.perf_counter()
    async for _ in engine.generate("warm up", FIRST_TOKEN, ["text"]):
        break
    return (time.perf_counter() - start) * 1e3


async def _decode(engine: AsyncOmni) -> list[int]:
    """Token ids of a greedy, fixed-length decode."""
    ids: list[int] = []
    async for out in engine.generate(DECODE_PROMPT, DECODE, ["text"]):
        ids.extend(out.new_token_ids)
    return ids


def _check(op: str, acks: list[dict[str, Any]]) -> dict[str, Any]:
    if not acks or any(a.get("status") != "SUCCESS" for a in acks):
        raise ControlBenchError(f"{op} did not succeed: {acks}")
    return acks[0]


async def _cycle(engine: AsyncOmni, level: int, reference: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    slept_ack = _check(f"sleep level {level}", await engine.sleep([0], level=level))
    slept = time.perf_counter()
    woke_ack = _check(f"wake after level {level}", await engine.wake_up([0]))
    await engine.resume_generation([0])
    woke = time.perf_counter()
    first = await _first_token_ms(engine)
    after = await _decode(engine)  # not timed
    return {
        "sleep_ms": (slept - start) * 1e3,
        "wake_ms": (woke - slept) * 1e3,
        "first_token_after_wake_ms": first,
        "freed_mib": slept_ack["freed_bytes"] / 2**20,
        "restore_gbps": woke_ack["metadata"].get("gbps", 0.0),
        "reload_gbps": woke_ack["metadata"].get("reload_gbps", 0.0),
        "cuda_graph_recalled": bool(woke_ack["metadata"]["cuda_graph_recalled"]),
        "same_output": after == reference,
        "decode_ids_after": after,
    }


def summarize(name: str, level: int, cycles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table row: medians of the timings, and each flag only if it held every cycle."""
    row: dict[str, Any] = {"pipeline": name, "level": level}
    for key in TIMED_KEYS:
        row[key] = statistics.median(c[key] for c in cycles)
    row["first_sleep_ms"] = cycles[0]["sleep_ms"]
    for key in FLAG_KEYS:
        row[key] = all(c[key] for c in cycles)
    # Kept in the JSON only: what came out after a wake that did not match, if one did not.
    mismatch = [c["decode_ids_after"] for c in cycles if not c["same_output"]]
    if mismatch:
        row["decode_ids_after_mismatch"] = mismatch[0]
    return row


def add_read_baseline(row: dict[str, Any], baseline: dict[str, float]) -> None:
    """A level-2 row's reload beside the plain reads of the same files (``read_baseline``)."""
    for key in ("read_gbps", "read_threads_gbps", "fresh_read_gbps"):
        row[key] = baseline[key]
    row["reload_vs_read"] = row["reload_gbps"] / baseline["read_gbps"]
    row["reload_vs_fresh_read"] = row["reload_gbps"] / baseline["fresh_read_gbps"]


def add_cold_start(row: dict[str, Any], cold_ms: float) -> None:
    row["cold_start_ms"] = cold_ms
    row["wake_speedup_vs_cold_start"] = cold_ms / (
        row["wake_ms"] + row["first_token_after_wake_ms"]
    )


def cold_start_ms(name: str, device: str) -> float:
    start = time.perf_counter()
    engine = AsyncOmni.from_pipeline(name, device=device, enable_sleep_mode=True)
    try:
        asyncio.run(_first_token_ms(engine))
    finally:
        engine.shutdown()
    return (time.perf_counter() - start) * 1e3


def bench_pipeline(
    name: str,
    device: str,
    repeats: int,
    cold_starts: int = 2,
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows for levels 1 and 2; ``on_rows`` gets them (without the cold start) as soon as
    the cycles are done."""
    config = load_pipeline(name, device=device)  # build the models outside the timings
    engine = AsyncOmni.from_pipeline(name, device=device, enable_sleep_mode=True)
    rows: list[dict[str, Any]] = []
    try:

        async def cycles() -> None:
            await _first_token_ms(engine)  # warm-up
            reference = await _decode(engine)
            if len(reference) != DECODE["max_tokens"]:
                raise ControlBenchError(
                    f"the reference decode gave {len(reference)} tokens, "
                    f"expected {DECODE['max_tokens']}"
                )
            for level in (1, 2):
                results = [await _cycle(engine, level, reference) for _ in range(repeats)]
                row = summarize(name, level, results)
                row["decode_ids_before"] = reference
                rows.append(row)

        asyncio.run(cycles())
    finally:
        engine.shutdown()
    baseline = read_baselines(
        checkpoint_files(config.stages[0].model),
        stage_threads(config.stages[0], len(config.stages)),
    )
    for row in rows:
        if row["level"] == 2:
            add_read_baseline(row, baseline)
    if on_rows is not None:
        on_rows(rows)
    cold = statistics.median(cold_start_ms(name, device) for _ in range(cold_starts))
    for row in rows:
        add_cold_start(row, cold)
    return rows


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: tuple[str, ...] = ("tiny-chat", "bench"),
    repeats: int = 3,
    cold_starts: int = 2,
) -> str:
    if repeats < 1 or cold_starts < 1:
        raise ValueError(f"repeats and cold_starts must be at least 1: {repeats}, {cold_starts}")
    name = f"control-{device.replace(':', '')}"
    rows: list[dict[str, Any]] = []

    def save(new: list[dict[str, Any]]) -> None:
        write_results(out_dir, name, [*rows, *new], COLUMNS)

    for pipeline in pipelines:
        rows += bench_pipeline(pipeline, device, repeats, cold_starts, on_rows=save)
        save([])
    return write_results(out_dir, name, rows, COLUMNS)
