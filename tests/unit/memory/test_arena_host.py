import torch
from safetensors.torch import save_file
from torch import nn

from omnistage.memory import Arena, ArenaError, ArenaWakeError, HostBackend, process_resident_bytes
from omnistage.models.loader import load_module
from tests.unit.memory.residency import resident_bytes

MiB = 1024 * 1024


class Blob(nn.Module):
    """256 MiB of float32 parameters in four tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4096, 4096), requires_grad=False)
        self.b = nn.Parameter(torch.randn(4096, 4096), requires_grad=False)
        self.c = nn.Parameter(torch.randn(4096, 4096), requires_grad=False)
        self.d = nn.Parameter(torch.randn(4096, 4096), requires_grad=False)


def test_discard_releases_resident_memory_and_reload_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    module = Blob()
    path = tmp_path / "blob.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    reference = {k: v.clone() for k, v in module.state_dict().items()}
    arena = Arena("cpu")
    nbytes = arena.adopt(module)
    assert nbytes >= 256 * MiB
    ptrs = {k: v.data_ptr() for k, v in module.state_dict().items()}

    before = process_resident_bytes()
    report = arena.sleep(discard=("weights",))
    after = process_resident_bytes()
    assert report.discarded_tags == ["weights"]
    assert before - after >= 0.95 * 256 * MiB
    assert not arena.is_valid("weights")

    wake = arena.wake()
    assert wake.invalid_tags == ["weights"] and not arena.is_valid("weights")
    load_module(module, path)
    arena.mark_valid("weights")
    for k, v in module.state_dict().items():
        assert v.data_ptr() == ptrs[k]
        assert torch.equal(v, reference[k])
    arena.close()


def test_offload_and_wake_is_bit_exact_and_module_forward_unchanged():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8))
    x = torch.randn(5, 64)
    expected = model(x).detach().clone()
    arena = Arena("cpu")
    arena.adopt(model)
    assert torch.equal(model(x), expected)
    report = arena.sleep(offload=("weights",))
    assert report.offloaded_tags == ["weights"] and report.backup_bytes > 0
    assert arena.stats()["weights"].resident_bytes == 0
    wake = arena.wake()
    assert wake.restored_tags == ["weights"] and arena.is_valid("weights")
    assert torch.equal(model(x), expected)
    arena.close()


def test_sleep_and_wake_are_reported_noops_when_repeated():
    arena = Arena("cpu")
    t = arena.empty((1024,), torch.float32, "kv_cache")
    t.fill_(3.0)
    assert arena.wake(["kv_cache"]).skipped_tags == ["kv_cache"]
    assert arena.sleep(offload=["kv_cache"]).offloaded_tags == ["kv_cache"]
    again = arena.sleep(offload=["kv_cache"])
    assert again.is_noop and again.skipped_tags == ["kv_cache"]
    arena.wake()
    assert arena.wake().is_noop
    assert torch.all(t == 3.0)


def test_sleeping_deeper_drops_host_copy():
    arena = Arena("cpu")
    arena.empty((4096,), torch.float32, "weights").fill_(1.0)
    arena.sleep(offload=["weights"])
    assert arena.stats()["weights"].backup_bytes > 0
    deeper = arena.sleep(discard=["weights"])
    assert deeper.discarded_tags == ["weights"]
    stats = arena.stats()["weights"]
    assert stats.backup_bytes == 0 and stats.is_asleep and not stats.is_valid
    assert arena.wake().invalid_tags == ["weights"]


def test_failed_wake_rolls_back_and_retry_succeeds():
    backend = HostBackend(capacity_bytes=8 * MiB)
    arena = Arena("cpu", backend=backend)
    first = arena.empty((MiB,), torch.float32, "weights")  # 4 MiB
    second = arena.empty((MiB // 2,), torch.float32, "weights")  # 2 MiB
    first.fill_(1.5)
    second.fill_(-2.0)
    arena.sleep(offload=["weights"])
    other = arena.empty((MiB,), torch.float32, "scratch")  # takes 4 of the 8 MiB
    try:
        arena.wake(["weights"])
        raise AssertionError("wake should have failed")
    except ArenaWakeError as exc:
        assert "capacity" in str(exc) and exc.report.error
    stats = arena.stats()["weights"]
    assert stats.is_asleep and stats.resident_bytes == 0 and stats.backup_bytes > 0
    assert backend.mapped_bytes == arena.stats()["scratch"].resident_bytes
    del other
    arena.sleep(discard=["scratch"])
    report = arena.wake(["weights"])
    assert report.restored_tags == ["weights"]
    assert torch.all(first == 1.5) and torch.all(second == -2.0)


def test_unknown_tag_and_asleep_allocation_are_errors():
    arena = Arena("cpu")
    arena.empty((16,), torch.float32, "weights")
    try:
        arena.sleep(discard=["nope"])
        raise AssertionError("expected ArenaError")
    except ArenaError as exc:
        assert "nope" in str(exc)
    arena.sleep(discard=["weights"])
    try:
        arena.empty((16,), torch.float32, "weights")
        raise AssertionError("expected ArenaError")
    except ArenaError as exc:
        assert "asleep" in str(exc)


def test_an_on_touch_tensor_comes_back_empty_and_fills_page_by_page():
    arena = Arena("cpu")
    cache = arena.empty((16 * MiB,), torch.uint8, "kv_cache", on_touch=True)
    weights = arena.empty((4 * MiB,), torch.uint8, "weights")
    cache.fill_(1)
    weights.fill_(2)
    assert resident_bytes(cache) == 16 * MiB
    arena.sleep(discard=["kv_cache", "weights"])
    assert resident_bytes(cache) == 0 and resident_bytes(weights) == 0
    report = arena.wake()
    assert sorted(report.invalid_tags) == ["kv_cache", "weights"]
    assert resident_bytes(weights) == 4 * MiB  # populated up front, as before
    assert resident_bytes(cache) == 0  # nothing faulted in by the wake
    cache[: 10 * 4096].fill_(3)  # a first use touches small pages, not 2 MiB ones
    assert resident_bytes(cache) == 10 * 4096
    stats = arena.stats()  # the figures operators see say the same
    assert stats["kv_cache"].resident_bytes == 10 * 4096
    assert stats["weights"].resident_bytes == stats["weights"].reserved_bytes
    assert int(cache[:4096].sum()) == 3 * 4096 and int(cache[10 * 4096 :].sum()) == 0
    arena.close()
