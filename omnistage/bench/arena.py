"""Arena sleep/wake throughput against a plain torch copy of the same bytes, same run."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from omnistage.bench.report import write_results
from omnistage.memory import Arena, process_resident_bytes

MiB = 1024 * 1024
COLUMNS = [
    "size_mib",
    "copy_gbps",
    "offload_sleep_gbps",
    "offload_wake_gbps",
    "wake_vs_copy",
    "discard_sleep_ms",
    "discard_wake_ms",
    "rss_freed_mib",
]


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_size(nbytes: int, device: str, repeats: int) -> dict[str, Any]:
    arena = Arena(device)
    data = arena.empty((nbytes,), torch.uint8, "weights")
    data.random_(0, 255)
    dst = torch.empty_like(data)
    dst.copy_(data)  # fault the destination in before timing
    copy_s = statistics.median(_timed(lambda: dst.copy_(data))[0] for _ in range(repeats))
    sleep_s, wake_s, rss_freed = [], [], []
    for _ in range(repeats):
        before = process_resident_bytes()
        s, _ = _timed(lambda: arena.sleep(offload=["weights"]))
        after = process_resident_bytes()
        w, _ = _timed(arena.wake)
        sleep_s.append(s)
        wake_s.append(w)
        rss_freed.append(before - after)
    discard_sleep, discard_wake = [], []
    for _ in range(repeats):
        s, _ = _timed(lambda: arena.sleep(discard=["weights"]))
        w, _ = _timed(arena.wake)
        data.fill_(1)  # what a reload would do: fault the pages back in (not timed)
        arena.mark_valid("weights")
        discard_sleep.append(s)
        discard_wake.append(w)
    arena.close()
    gb = nbytes / 1e9
    copy_gbps = gb / copy_s
    wake_gbps = gb / statistics.median(wake_s)
    return {
        "size_mib": nbytes // MiB,
        "copy_gbps": copy_gbps,
        "offload_sleep_gbps": gb / statistics.median(sleep_s),
        "offload_wake_gbps": wake_gbps,
        "wake_vs_copy": wake_gbps / copy_gbps,
        "discard_sleep_ms": statistics.median(discard_sleep) * 1e3,
        "discard_wake_ms": statistics.median(discard_wake) * 1e3,
        "rss_freed_mib": statistics.median(rss_freed) / MiB,
    }


def run(
    out_dir: str,
    device: str = "cpu",
    sizes_mib: tuple[int, ...] = (64, 256, 1024),
    repeats: int = 3,
) -> str:
    rows = [bench_size(size * MiB, device, repeats) for size in sizes_mib]
    return write_results(out_dir, f"arena-{device.replace(':', '')}", rows, COLUMNS)
