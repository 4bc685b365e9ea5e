"""The CUDA VMM backend's driver-call logic, against a fake driver (no CUDA driver here)."""

import pytest
import torch

from omnistage.memory import Arena, ArenaError, ArenaWakeError
from omnistage.memory.backend import ArenaOutOfMemoryError
from tests.unit.memory.fake_cuda_driver import FakeDriver, FakeVmmBackend

MiB = 1024 * 1024


def make_arena(driver: FakeDriver) -> tuple[Arena, FakeVmmBackend]:
    backend = FakeVmmBackend(driver)
    return Arena("cpu", backend=backend), backend


def test_allocation_maps_granular_chunks_with_context_current():
    driver = FakeDriver()
    arena, backend = make_arena(driver)
    arena.empty((10 * MiB,), torch.uint8, "weights")
    # 10 MiB rounds to 10 MiB (granularity 2 MiB) and maps as chunks of 4 + 4 + 2 MiB.
    assert driver.calls.count("cuMemCreate") == 3
    assert driver.calls.count("cuMemSetAccess") == 3
    assert driver.physical_bytes == 10 * MiB
    assert driver.current_context == "ctx0"


def test_sleep_releases_physical_memory_but_keeps_the_address():
    driver = FakeDriver()
    arena, backend = make_arena(driver)
    t = arena.empty((6 * MiB,), torch.uint8, "weights")
    t.copy_(torch.arange(t.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    expected = t.clone()
    reserved = dict(driver.reserved)
    report = arena.sleep(offload=["weights"])
    assert driver.physical_bytes == 0 and driver.mappings == {}
    assert driver.reserved == reserved
    assert report.freed_bytes == 6 * MiB and backend.num_synchronize >= 1
    arena.wake()
    assert driver.physical_bytes == 6 * MiB
    assert torch.equal(backend.memory[next(iter(reserved))], expected)


def test_host_backup_is_allocated_once_across_cycles(monkeypatch):
    driver = FakeDriver()
    arena, backend = make_arena(driver)
    arena.empty((4 * MiB,), torch.uint8, "weights")
    allocations = []
    original = backend.new_host_backup
    monkeypatch.setattr(backend, "new_host_backup", lambda n: allocations.append(n) or original(n))
    for _ in range(3):
        arena.sleep(offload=["weights"])
        arena.wake()
    assert allocations == [4 * MiB]


def test_failure_half_way_through_wake_rolls_back_and_retry_succeeds():
    driver = FakeDriver()
    arena, backend = make_arena(driver)
    a = arena.empty((8 * MiB,), torch.uint8, "weights")
    a.fill_(7)
    arena.sleep(offload=["weights"])
    creates_so_far = driver.calls.count("cuMemCreate")
    driver.fail_on["cuMemCreate"] = creates_so_far + 2  # second chunk of the wake fails
    with pytest.raises(ArenaWakeError) as info:
        arena.wake()
    assert "OUT_OF_MEMORY" in str(info.value)
    assert driver.physical_bytes == 0 and driver.mappings == {}
    stats = arena.stats()["weights"]
    assert stats.is_asleep and stats.resident_bytes == 0 and stats.backup_bytes == 8 * MiB
    driver.fail_on.clear()
    assert arena.wake().restored_tags == ["weights"]
    assert torch.all(backend.memory[next(iter(driver.reserved))] == 7)


def test_allocation_failure_frees_the_reserved_range():
    driver = FakeDriver(capacity_bytes=4 * MiB)
    arena, _ = make_arena(driver)
    with pytest.raises(ArenaOutOfMemoryError):
        arena.empty((6 * MiB,), torch.uint8, "weights")
    assert driver.reserved == {} and driver.handles == {}


def test_close_unmaps_and_frees_everything():
    driver = FakeDriver()
    arena, _ = make_arena(driver)
    arena.empty((3 * MiB,), torch.uint8, "weights")
    arena.empty((1 * MiB,), torch.uint8, "kv_cache")
    arena.sleep(discard=["kv_cache"])
    arena.close()
    assert driver.reserved == {} and driver.handles == {} and driver.mappings == {}


def test_sleeping_deeper_drops_the_pinned_host_copy_and_a_later_offload_reallocates(monkeypatch):
    driver = FakeDriver()
    arena, backend = make_arena(driver)
    arena.empty((4 * MiB,), torch.uint8, "weights").fill_(5)
    allocations = []
    original = backend.new_host_backup
    monkeypatch.setattr(backend, "new_host_backup", lambda n: allocations.append(n) or original(n))
    arena.sleep(offload=["weights"])
    arena.sleep(discard=["weights"])
    assert arena.stats()["weights"].backup_bytes == 0
    assert all(r.host_backup is None for r in arena._tags["weights"].regions)
    arena.wake()
    arena.sleep(offload=["weights"])
    assert allocations == [4 * MiB, 4 * MiB]


def test_unmap_failure_half_way_leaves_the_tag_asleep_and_invalid():
    driver = FakeDriver()
    arena, _ = make_arena(driver)
    arena.empty((8 * MiB,), torch.uint8, "weights")  # two chunks
    driver.fail_on["cuMemUnmap"] = driver.calls.count("cuMemUnmap") + 2
    with pytest.raises(ArenaError, match="cuMemUnmap"):
        arena.sleep(discard=["weights"])
    stats = arena.stats()["weights"]
    assert stats.is_asleep and not stats.is_valid
    assert len(driver.mappings) == 1  # the failing chunk is still mapped, the other is not
    driver.fail_on.clear()
    assert arena.wake().invalid_tags == ["weights"]
    assert driver.physical_bytes == 8 * MiB and len(driver.mappings) == 2
    arena.close()
    assert driver.reserved == {} and driver.handles == {} and driver.mappings == {}
