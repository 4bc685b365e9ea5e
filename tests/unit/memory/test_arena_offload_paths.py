"""Level-1 offloads on the host: pages moved (the default where the kernel can) or copied,
each bit-exact, and a failure half-way through either direction rolled back."""

import pytest
import torch

from omnistage.memory import Arena, ArenaError, ArenaWakeError, HostBackend
from omnistage.memory.host import page_mover

MiB = 1024 * 1024
MODES = ["move", "copy"]


def needs_mover(mode: str) -> None:
    if mode == "move" and page_mover() is None:
        pytest.skip("this kernel cannot move pages (mremap MREMAP_DONTUNMAP, Linux 5.7+)")


def arena_with_regions(mode: str, capacity_bytes: int | None = None) -> tuple[Arena, list]:
    """Three regions under ``weights`` (2, 4 and 2 MiB: whole huge pages), filled with distinct random bytes."""
    needs_mover(mode)
    backend = HostBackend(capacity_bytes=capacity_bytes, move_pages=mode == "move")
    arena = Arena("cpu", backend=backend)
    torch.manual_seed(0)
    tensors = [arena.empty((n * MiB,), torch.uint8, "weights") for n in (2, 4, 2)]
    for t in tensors:
        t.random_(0, 256)
    return arena, [t.clone() for t in tensors]


def contents(arena: Arena) -> list[torch.Tensor]:
    regions = arena._tags["weights"].regions
    return [arena.backend.as_tensor(r)[: r.nbytes] for r in regions]


def same(arena: Arena, reference: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(t[: len(ref)], ref) for t, ref in zip(contents(arena), reference, strict=True)
    )


def failing_on(backend: HostBackend, method: str, call: int, monkeypatch) -> None:
    """Make ``backend.<method>`` raise on its ``call``-th call (1-based) from now on."""
    original = getattr(backend, method)
    calls = {"n": 0}

    def flaky(region):
        calls["n"] += 1
        if calls["n"] == call:
            raise OSError(f"injected failure in {method}")
        return original(region)

    monkeypatch.setattr(backend, method, flaky)


def test_this_kernel_moves_pages():
    # The CI machine's kernel (Linux >= 5.7) has MREMAP_DONTUNMAP: the host default is moves.
    assert page_mover() is not None
    assert HostBackend().moves_pages
    assert not HostBackend(move_pages=False).moves_pages


@pytest.mark.parametrize("mode", MODES)
def test_offload_and_restore_are_bit_exact_at_the_same_addresses(mode):
    arena, reference = arena_with_regions(mode)
    ptrs = [t.data_ptr() for t in contents(arena)]
    for _ in range(3):
        report = arena.sleep(offload=["weights"])
        assert report.offloaded_tags == ["weights"]
        assert report.backup_bytes == report.freed_bytes == 8 * MiB
        stats = arena.stats()["weights"]
        assert stats.resident_bytes == 0 and stats.backup_bytes == 8 * MiB
        assert arena.backend.mapped_bytes == 0  # type: ignore[attr-defined]
        # While asleep the backups hold the bytes (moved or copied there).
        backups = [r.host_backup for r in arena._tags["weights"].regions]
        assert all(
            torch.equal(b[: len(ref)], ref) for b, ref in zip(backups, reference, strict=True)
        )
        wake = arena.wake()
        assert wake.restored_tags == ["weights"] and wake.restored_bytes == 8 * MiB
        assert [t.data_ptr() for t in contents(arena)] == ptrs
        assert same(arena, reference)
    arena.close()


def test_moved_out_region_is_empty_and_the_backup_needs_no_fresh_pages():
    arena, reference = arena_with_regions("move")
    arena.sleep(offload=["weights"])
    region = arena._tags["weights"].regions[0]
    # The region's address stays mapped, empty: what a stray read sees is zeros, not stale data.
    assert int(arena.backend.as_tensor(region)[:4096].sum()) == 0
    arena.wake()
    assert same(arena, reference)
    arena.close()


@pytest.mark.parametrize("mode", MODES)
def test_failure_half_way_through_an_offload_is_rolled_back(mode, monkeypatch):
    arena, reference = arena_with_regions(mode)
    failing_on(arena.backend, "save", 2, monkeypatch)  # the first region is already saved
    with pytest.raises(ArenaError, match="rolled back"):
        arena.sleep(offload=["weights"])
    stats = arena.stats()["weights"]
    assert not stats.is_asleep and stats.is_valid and stats.resident_bytes == 8 * MiB
    assert same(arena, reference)
    monkeypatch.undo()
    arena.sleep(offload=["weights"])
    arena.wake()
    assert same(arena, reference)
    arena.close()


@pytest.mark.parametrize("mode", MODES)
def test_failure_half_way_through_a_restore_is_rolled_back_and_the_next_wake_works(
    mode, monkeypatch
):
    arena, reference = arena_with_regions(mode)
    arena.sleep(offload=["weights"])
    failing_on(arena.backend, "restore", 3, monkeypatch)  # two regions are already back
    with pytest.raises(ArenaWakeError) as info:
        arena.wake()
    assert "injected" in str(info.value) and not info.value.report.restored_tags
    stats = arena.stats()["weights"]
    assert stats.is_asleep and stats.resident_bytes == 0 and stats.backup_bytes == 8 * MiB
    assert arena.backend.mapped_bytes == 0  # type: ignore[attr-defined]
    monkeypatch.undo()
    assert arena.wake().restored_tags == ["weights"]
    assert same(arena, reference)
    arena.close()


def test_a_restore_beyond_capacity_is_rolled_back(monkeypatch):
    arena, reference = arena_with_regions("move", capacity_bytes=10 * MiB)
    arena.sleep(offload=["weights"])
    scratch = arena.empty((4 * MiB,), torch.uint8, "scratch")  # 4 of the 10 MiB
    with pytest.raises(ArenaWakeError, match="capacity"):
        arena.wake(["weights"])  # 2 + 4 MiB fit, the last 2 MiB do not
    assert arena.stats()["weights"].resident_bytes == 0
    del scratch
    arena.sleep(discard=["scratch"])
    arena.wake(["weights"])
    assert same(arena, reference)
    arena.close()


def test_when_putting_an_offload_back_fails_too_the_tag_is_asleep_and_invalid(monkeypatch):
    arena, _ = arena_with_regions("move")
    failing_on(arena.backend, "save", 2, monkeypatch)
    failing_on(arena.backend, "unsave", 1, monkeypatch)
    with pytest.raises(ArenaError, match="contents lost"):
        arena.sleep(offload=["weights"])
    stats = arena.stats()["weights"]
    assert stats.is_asleep and not stats.is_valid and stats.resident_bytes == 0
    monkeypatch.undo()
    # The consistent way on: wake with fresh memory, refill, mark valid.
    assert arena.wake().invalid_tags == ["weights"]
    for t in contents(arena):
        t.fill_(5)
    arena.mark_valid("weights")
    assert arena.is_valid("weights")
    arena.close()


def test_deeper_sleep_and_close_give_the_moved_pages_back():
    arena, _ = arena_with_regions("move")
    arena.sleep(offload=["weights"])
    backend = arena.backend
    assert len(backend._backup_owner) == 3  # type: ignore[attr-defined]
    arena.sleep(discard=["weights"])
    assert arena.stats()["weights"].backup_bytes == 0
    assert not backend._backup_owner  # type: ignore[attr-defined]
    arena.wake()
    arena.sleep(offload=["weights"])
    arena.close()
    assert not backend._backup_owner  # type: ignore[attr-defined]


def test_fill_leaves_fresh_memory_to_the_writer():
    arena, _ = arena_with_regions("move")
    arena.sleep(discard=["weights"])
    report = arena.wake(fill=["weights"])
    assert report.invalid_tags == ["weights"] and report.mapped_bytes == 8 * MiB
    for t in contents(arena):
        t.fill_(9)  # faulted in by the writes
    arena.mark_valid("weights")
    assert all(bool((t == 9).all()) for t in contents(arena))
    arena.close()
