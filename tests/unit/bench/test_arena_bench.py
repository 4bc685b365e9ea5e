"""The arena benchmark's logic, including its CUDA branch run against a CPU stand-in.

The stand-in is honest about what it checks and what it cannot: ``synchronize`` is a
recording no-op (so the test sees *where* the benchmark synchronizes, not that
``torch.cuda.synchronize`` works), the "device memory in use" is the host backend's mapped
bytes (so the freed figures follow the arena, not ``torch.cuda.mem_get_info``), and the
baseline buffer is plain host memory instead of pinned memory.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omnistage.bench import arena as bench
from omnistage.memory import Arena, HostBackend
from tests.unit.memory.fake_cuda_driver import FakeDriver, FakeVmmBackend

MiB = 1024 * 1024


class Log:
    """Records the synchronizes and clock reads in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.now = 0.0

    def sync(self) -> None:
        self.events.append("sync")

    def clock(self) -> float:
        self.events.append("clock")
        self.now += 1e-3
        return self.now


def cuda_stand_in(log: Log, vmm: bool) -> tuple[bench.DeviceOps, dict[str, Any]]:
    """With ``vmm`` the arena runs the real CUDA VMM backend logic over the fake driver
    (memory simulated on the host, "device memory in use" = the driver's physical bytes);
    without, the host backend (in use = its mapped bytes)."""
    held: dict[str, Any] = {"cleanups": 0}

    def new_arena() -> Arena:
        if vmm:
            driver = FakeDriver()
            held["used"] = lambda: driver.physical_bytes
            held["arena"] = Arena("cpu", backend=FakeVmmBackend(driver))
        else:
            backend = HostBackend(use_huge_pages=False)
            held["used"] = lambda: backend.mapped_bytes
            held["arena"] = Arena("cpu", backend=backend)
        return held["arena"]

    def cleanup() -> None:
        held["cleanups"] += 1

    ops = bench.DeviceOps(
        device="cuda:0",
        cuda=True,
        synchronize=log.sync,
        used_bytes=lambda: held["used"](),
        baseline_buffer=lambda n: torch.empty(n, dtype=torch.uint8),
        new_arena=new_arena,
        cleanup=cleanup,
    )
    return ops, held


def test_timed_synchronizes_before_start_and_before_stop():
    log = Log()
    elapsed = bench.timed(lambda: log.events.append("work"), log.sync, log.clock)
    assert log.events == ["sync", "clock", "work", "sync", "clock"]
    assert elapsed == pytest.approx(1e-3)


@pytest.mark.parametrize("vmm", [True, False], ids=["fake-vmm", "host"])
def test_cuda_branch_synchronizes_before_every_timing_stop_and_reports_device_memory(vmm):
    log = Log()
    ops, held = cuda_stand_in(log, vmm)
    repeats = 2
    row = bench.bench_size(2 * MiB, repeats, ops, clock=log.clock)

    clocks = [i for i, e in enumerate(log.events) if e == "clock"]
    # Every timing is a start and a stop, and each of them directly follows a synchronize.
    assert clocks and len(clocks) % 2 == 0
    assert all(log.events[i - 1] == "sync" for i in clocks)
    # 2 copy directions, 1 warm-up sleep, level 1 sleep + wake, level 2 sleep + wake.
    assert len(clocks) // 2 == 2 * repeats + 1 + 2 * repeats + 2 * repeats
    assert held["cleanups"] == 1

    assert set(bench.CUDA_COLUMNS) <= set(row)
    assert "rss_freed_mib" not in row and row["baseline"] == "pinned host <-> device"
    assert row["size_mib"] == 2 and row["bit_exact"] is True
    # The stand-in's "device memory" is what the arena has mapped: all of it is freed, and
    # every wake gave the bytes back (the fake VMM fills re-mapped memory with garbage).
    assert row["device_freed_mib"] == 2 and row["discard_device_freed_mib"] == 2
    for key in ("copy_out_gbps", "copy_in_gbps", "offload_sleep_gbps", "offload_wake_gbps"):
        assert row[key] > 0
    assert row["sleep_vs_copy"] == pytest.approx(row["offload_sleep_gbps"] / row["copy_out_gbps"])
    assert row["wake_vs_copy"] == pytest.approx(row["offload_wake_gbps"] / row["copy_in_gbps"])


def test_cpu_row_has_the_cpu_columns():
    row = bench.bench_size(2 * MiB, 1, bench.device_ops("cpu"))
    assert list(bench.columns("cpu")) == bench.CPU_COLUMNS
    assert set(bench.CPU_COLUMNS) <= set(row)
    assert "device_freed_mib" not in row
    assert row["bit_exact"] is True and row["discard_rss_freed_mib"] > 0


def test_the_host_measures_moved_and_copied_offloads_against_one_baseline():
    assert bench.offload_modes("cpu") == ("move", "copy")
    assert bench.offload_modes("cuda:0") == ("copy",)
    for mode in ("move", "copy"):
        ops = bench.device_ops("cpu", mode)
        row = bench.bench_size(4 * MiB, 1, ops)
        assert row["offload"] == mode and row["bit_exact"] is True
        assert ops.new_arena().backend.moves_pages == (mode == "move")


def test_device_ops_for_cuda_are_built_without_touching_cuda():
    ops = bench.device_ops("cuda:0")  # only closures: nothing runs until they are called
    assert ops.cuda and ops.freed_key == "device_freed_mib"
    assert bench.columns("cuda:1") == bench.CUDA_COLUMNS
    assert not bench.device_ops("cpu").cuda


def test_a_run_cut_short_keeps_the_sizes_it_finished(tmp_path, monkeypatch):
    real = bench.bench_size

    def fail_on_second(nbytes: int, repeats: int, ops: bench.DeviceOps) -> dict[str, Any]:
        if nbytes > MiB:
            raise RuntimeError("cut")
        return real(nbytes, repeats, ops)

    monkeypatch.setattr(bench, "bench_size", fail_on_second)
    with pytest.raises(RuntimeError, match="cut"):
        bench.run(str(tmp_path), sizes_mib=(1, 2), repeats=1)
    rows = json.loads((tmp_path / "arena-cpu.json").read_text())["rows"]
    assert [(r["size_mib"], r["offload"]) for r in rows] == [(1, "move"), (1, "copy")]
    assert "| 1 |" in (tmp_path / "arena-cpu.md").read_text()


def test_run_refuses_zero_repeats(tmp_path):
    with pytest.raises(ValueError):
        bench.run(str(tmp_path), sizes_mib=(1,), repeats=0)
