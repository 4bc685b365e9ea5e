"""Arena sleep/wake throughput against a plain copy of the same bytes, measured in the same run.

``run`` writes one table row per size (``bench_size``; on the host one per offload mode): one
arena tensor under the tag ``weights`` slept at level 1 (``offload_*``, against a plain
``copy_`` of the same bytes: device ↔ pinned host on CUDA, host ↔ host on the CPU) and at
level 2 (``discard_*``), with the memory each sleep freed and whether every wake gave the
bytes back. ``DeviceOps`` holds what differs between CUDA and the host. Timings are medians
of ``repeats`` cycles after one untimed warm-up; results are written after each size.

See docs/benchmarks.md, "Arena: sleep and wake throughput vs a plain copy" (the columns) and
"GPU" (the CUDA run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.bench.report import write_results
from omnistage.memory import Arena, HostBackend, device_used_bytes, process_resident_bytes
from omnistage.memory.host import page_mover

MiB = 1024 * 1024
_COMMON_COLUMNS = [
    "size_mib",
    "offload",
    "copy_out_gbps",
    "offload_sleep_gbps",
    "sleep_vs_copy",
    "copy_in_gbps",
    "offload_wake_gbps",
    "wake_vs_copy",
    "first_sleep_ms",
    "bit_exact",
    "discard_sleep_ms",
    "discard_wake_ms",
]
CPU_COLUMNS = [*_COMMON_COLUMNS, "rss_freed_mib", "discard_rss_freed_mib"]
CUDA_COLUMNS = [*_COMMON_COLUMNS, "device_freed_mib", "discard_device_freed_mib"]

Clock = Callable[[], float]


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def columns(device: str) -> list[str]:
    """The table's columns: freed memory is device memory on CUDA, process RSS on the host."""
    return CUDA_COLUMNS if is_cuda(device) else CPU_COLUMNS


@dataclass
class DeviceOps:
    """What differs between devices; ``device_ops`` builds the real ones, tests stand-ins."""

    device: str
    cuda: bool
    synchronize: Callable[[], None]
    used_bytes: Callable[[], int]  # device memory in use (CUDA) or process RSS (host)
    baseline_buffer: Callable[[int], torch.Tensor]  # the other end of the plain copy
    new_arena: Callable[[], Arena]
    cleanup: Callable[[], None]  # after each size: give cached memory back
    offload: str = "copy"  # how a level-1 offload keeps the bytes: "copy" or "move"

    @property
    def freed_key(self) -> str:
        return "device_freed_mib" if self.cuda else "rss_freed_mib"


def _empty_host_cache() -> None:
    empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()


def offload_modes(device: str) -> tuple[str, ...]:
    """The level-1 offload paths to measure: both on a host whose kernel can move pages."""
    if is_cuda(device) or page_mover() is None:
        return ("copy",)
    return ("move", "copy")


def device_ops(device: str, offload: str | None = None) -> DeviceOps:
    if is_cuda(device):
        dev = torch.device(device)

        def cuda_cleanup() -> None:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            _empty_host_cache()  # pinned blocks, so the next size pins its own

        return DeviceOps(
            device=device,
            cuda=True,
            synchronize=lambda: torch.cuda.synchronize(dev),
            used_bytes=lambda: device_used_bytes(dev),  # torch.cuda.mem_get_info
            baseline_buffer=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
            new_arena=lambda: Arena(dev),
            cleanup=cuda_cleanup,
        )
    mode = offload or offload_modes(device)[0]
    return DeviceOps(
        device=device,
        cuda=False,
        synchronize=lambda: None,
        used_bytes=process_resident_bytes,
        baseline_buffer=lambda n: torch.empty(n, dtype=torch.uint8),
        new_arena=lambda: Arena(device, backend=HostBackend(move_pages=mode == "move")),
        cleanup=lambda: None,
        offload=mode,
    )


def timed(fn: Callable[[], Any], synchronize: Callable[[], None], clock: Clock) -> float:
    """Seconds ``fn`` took, the device synchronized before the start and before the stop
    (so queued work before is not counted, and asynchronous work of ``fn`` is)."""
    synchronize()
    start = clock()
    fn()
    synchronize()
    return clock() - start


def _measure(
    arena: Arena, nbytes: int, repeats: int, ops: DeviceOps, clock: Clock
) -> dict[str, Any]:
    """The raw timings (seconds) and readings (bytes); every tensor dies with this call."""
    sync = ops.synchronize
    data = arena.empty((nbytes,), torch.uint8, "weights")
    data.random_(0, 255)
    reference = data.clone()

    # Baseline: copy the same bytes out of the arena tensor and back into it (the contents
    # do not change), after one untimed copy each way (faults pages in).
    other = ops.baseline_buffer(nbytes)
    other.copy_(data)
    data.copy_(other)
    raw: dict[str, Any] = {
        "copy_out": [timed(lambda: other.copy_(data), sync, clock) for _ in range(repeats)],
        "copy_in": [timed(lambda: data.copy_(other), sync, clock) for _ in range(repeats)],
    }

    def cycles(
        sleep: Callable[[], Any], after_wake: Callable[[], Any]
    ) -> tuple[list[float], list[float], list[int], list[Any]]:
        """``repeats`` timed sleeps and wakes: their seconds, the bytes each sleep freed and
        what ``after_wake`` (not timed) gave after each wake."""
        sleep_s, wake_s, freed, after = [], [], [], []
        for _ in range(repeats):
            before = ops.used_bytes()
            sleep_s.append(timed(sleep, sync, clock))
            freed.append(before - ops.used_bytes())
            wake_s.append(timed(arena.wake, sync, clock))
            after.append(after_wake())
        return sleep_s, wake_s, freed, after

    # Level 1: offload and restore. The warm-up cycle allocates the host backup.
    raw["first_sleep"] = timed(lambda: arena.sleep(offload=["weights"]), sync, clock)
    arena.wake()
    sync()
    bit_exact = bool(torch.equal(data, reference))
    sleep_s, wake_s, freed, exact = cycles(
        lambda: arena.sleep(offload=["weights"]), lambda: bool(torch.equal(data, reference))
    )
    raw.update(sleep=sleep_s, wake=wake_s, freed=freed, bit_exact=bit_exact and all(exact))

    # Level 2: discard and map fresh memory.
    def reload() -> None:
        data.fill_(1)  # what a reload would do: touch the memory again (not timed)
        sync()
        arena.mark_valid("weights")

    discard_sleep, discard_wake, discard_freed, _ = cycles(
        lambda: arena.sleep(discard=["weights"]), reload
    )
    raw.update(discard_sleep=discard_sleep, discard_wake=discard_wake, discard_freed=discard_freed)
    return raw


def bench_size(
    nbytes: int, repeats: int, ops: DeviceOps, clock: Clock = time.perf_counter
) -> dict[str, Any]:
    """One table row for ``nbytes`` (see the module docstring)."""
    arena = ops.new_arena()
    try:
        raw = _measure(arena, nbytes, repeats, ops, clock)
    finally:
        arena.close()
        ops.cleanup()
    med = statistics.median
    gb = nbytes / 1e9
    copy_out_gbps, copy_in_gbps = gb / med(raw["copy_out"]), gb / med(raw["copy_in"])
    sleep_gbps, wake_gbps = gb / med(raw["sleep"]), gb / med(raw["wake"])
    freed_key = ops.freed_key
    return {
        "size_mib": nbytes // MiB,
        "offload": ops.offload,
        "copy_out_gbps": copy_out_gbps,
        "offload_sleep_gbps": sleep_gbps,
        "sleep_vs_copy": sleep_gbps / copy_out_gbps,
        "copy_in_gbps": copy_in_gbps,
        "offload_wake_gbps": wake_gbps,
        "wake_vs_copy": wake_gbps / copy_in_gbps,
        "first_sleep_ms": raw["first_sleep"] * 1e3,
        "bit_exact": raw["bit_exact"],
        "discard_sleep_ms": med(raw["discard_sleep"]) * 1e3,
        "discard_wake_ms": med(raw["discard_wake"]) * 1e3,
        freed_key: med(raw["freed"]) / MiB,
        f"discard_{freed_key}": med(raw["discard_freed"]) / MiB,
        "baseline": "pinned host <-> device" if ops.cuda else "resident host <-> host",
    }


def run(
    out_dir: str,
    device: str = "cpu",
    sizes_mib: tuple[int, ...] = (64, 256, 1024),
    repeats: int = 3,
) -> str:
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    name, cols = f"arena-{device.replace(':', '')}", columns(device)
    rows: list[dict[str, Any]] = []
    for size in sizes_mib:
        for mode in offload_modes(device):
            rows.append(bench_size(size * MiB, repeats, device_ops(device, mode)))
        write_results(out_dir, name, rows, cols)  # after each size: a cut run keeps these
    return write_results(out_dir, name, rows, cols)
