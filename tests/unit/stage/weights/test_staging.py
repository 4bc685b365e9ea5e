"""A stage's host staging of a trainer's update (``weights.staging``) and the checks made in
the same pass as a copy (``weights.checks``): a NaN or Inf anywhere is found, in every float
dtype, and finite values whose sum overflows are not refused."""

from __future__ import annotations

import pytest
import torch

from omnistage.stage.weights.checks import FUSED_BYTES, all_finite, copy_checked, copy_into
from omnistage.stage.weights.staging import StagingSet, locate, map_segment

BIG = FUSED_BYTES // 4 * 3 + 5  # float32 values over several blocks, the last one partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_non_finite_value_anywhere_is_found_fused_or_not(dtype):
    src, dst = torch.zeros(BIG, dtype=dtype), torch.empty(BIG, dtype=dtype)
    assert all_finite(src) and copy_checked(dst, src) and torch.equal(dst, src)
    for where, bad in [(0, float("nan")), (BIG // 2, float("inf")), (BIG - 1, float("-inf"))]:
        src[where] = bad
        assert not all_finite(src) and not copy_checked(dst, src)
        src[where] = 0.0


def test_finite_values_whose_sum_overflows_pass_and_a_copy_is_exact():
    src = torch.full((70_000,), 60_000.0, dtype=torch.float16)  # the sum is inf in float16
    dst = torch.empty_like(src)
    assert all_finite(src) and copy_checked(dst, src) and torch.equal(dst, src)
    ints = torch.arange(BIG)
    out = torch.empty_like(ints)
    assert copy_checked(out, ints) and torch.equal(out, ints)
    f8 = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)
    assert not all_finite(f8) and all_finite(f8[:1])
    strided = torch.randn(8, 6)[:, ::2]  # not a host byte copy: torch's copy
    target = torch.empty(8, 3)
    copy_into(target, strided)
    assert torch.equal(target, strided)


def test_a_shared_set_is_mapped_by_another_process_in_place():
    layout = (("a", torch.float32, (3, 5)), ("b", torch.bfloat16, (7,)), ("n", torch.int64, ()))
    staged = StagingSet(layout, shared=True)
    assert [t.data_ptr() % 64 for t in staged.tensors.values()] == [0, 0, 0]
    places = staged.locations(["a", "b", "n"])
    assert locate(staged.tensors["b"]) == (places[1]["shm"], places[1]["offset"])
    other = map_segment(str(places[0]["shm"]))  # what a trainer or another rank maps
    other[places[0]["offset"] : places[0]["offset"] + 4].view(torch.float32).fill_(2.5)
    assert staged.tensors["a"][0, 0] == 2.5
    assert locate(torch.zeros(3)) is None
    private = StagingSet(layout, shared=False)
    assert private.name is None and locate(private.tensors["a"]) is None
    with pytest.raises(ValueError):
        map_segment("../etc/passwd")


def test_short_shared_memory_stages_privately_and_the_trainer_shares_its_own(monkeypatch):
    from omnistage.rl.protocol import weights_checksum
    from omnistage.stage.background import run_to_answer
    from omnistage.stage.control import make_ack
    from omnistage.stage.weights.staging import StagingPool
    from omnistage.stage.weights.sync import WeightSync
    from tests.unit.stage.shared_tensors import Shared, describe

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    weights = {"w": torch.zeros(4, 3)}

    def apply(tensors: dict, version: str) -> object:
        for name, tensor in tensors.items():
            weights[name].copy_(tensor)
        return make_ack(0, weight_sources=[f"sync:{version}"], weight_version=version)

    sync = WeightSync(0, lambda: weights, apply, torch.device("cpu"))
    sync.init_weight_transfer("ipc")
    new = [("w", torch.randn(4, 3))]
    reply = run_to_answer(sync.start_weight_update(describe(new, shared_staging=True)))
    assert "staging" not in reply  # no shared staging to offer: the trainer's own segments
    shared = Shared()
    try:
        run_to_answer(sync.receive_weights(shared.chunk(new)))
    finally:
        shared.close()
    assert sync.finish_weight_update("v").metadata.weight_version == "v"
    assert weights_checksum(weights.items()) == weights_checksum(new)
    with pytest.raises(ValueError, match="shared memory"):  # a tensor-parallel stage's ranks
        StagingPool(True, pinned=False, required=True).new((("w", torch.float32, (4, 3)),))
