import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from omnistage.errors import InvalidRequestError, WeightsInvalidError
from omnistage.memory import Arena, HostBackend
from omnistage.models.loader import load_module
from omnistage.stage.sleep_control import SleepController


@pytest.fixture
def stage(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    arena = Arena("cpu")
    arena.adopt(model)
    arena.empty((4096,), torch.float32, "kv_cache")
    control = SleepController(
        arena,
        3,
        tmp_path,
        lambda path, strict, check_finite: load_module(model, path, strict=strict),
    )
    return model, control, tmp_path


def test_level2_wake_reloads_same_weights(stage):
    model, control, _ = stage
    expected = model.weight.detach().clone()
    ack = control.sleep(2)
    assert ack.status == "SUCCESS" and ack.stage_id == 3
    assert sorted(ack.metadata.tags) == ["kv_cache", "weights"]
    assert not control.weights_valid and control.is_sleeping
    with pytest.raises(WeightsInvalidError):
        control.check_can_generate()
    wake = control.wake_up()
    assert wake.status == "SUCCESS" and control.weights_valid and not control.is_sleeping
    assert torch.equal(model.weight, expected)


def test_level1_keeps_host_backup_and_repeats_are_skipped(stage):
    _, control, _ = stage
    ack = control.sleep(1)
    assert ack.metadata.host_backup_bytes > 0 and control.level == 1
    assert control.sleep(1).status == "SKIPPED"
    assert control.wake_up().status == "SUCCESS"
    assert control.wake_up().status == "SKIPPED"


def test_wake_without_reload_refuses_until_update(stage, tmp_path):
    model, control, folder = stage
    control.sleep(2)
    ack = control.wake_up(tags=["weights"], reload=False)
    assert ack.metadata.weights_valid is False
    with pytest.raises(WeightsInvalidError, match="update_weights"):
        control.check_can_generate()
    new = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    update = tmp_path / "update.safetensors"
    save_file(new, str(update))
    control.update_weights(update)
    control.check_can_generate()
    # a later level-2 cycle reloads the updated weights, not the original checkpoint
    control.sleep(2)
    control.wake_up()
    assert torch.all(model.weight == 0.5)


def test_tags_the_arena_lacks_name_the_field(stage):
    """(Levels, modes and tags of the vocabulary are checked where a ``Sleep`` is made.)"""
    _, control, _ = stage
    with pytest.raises(InvalidRequestError, match="tags"):
        control.sleep(1, tags=["activations"])


def test_wake_with_reload_after_a_wake_without_reload_reloads(stage):
    model, control, _ = stage
    expected = model.weight.detach().clone()
    control.sleep(2)
    control.wake_up(reload=False)
    ack = control.wake_up(reload=True)
    assert ack.status == "SUCCESS" and ack.metadata.weights_valid is True
    control.check_can_generate()
    assert torch.equal(model.weight, expected)


def test_failed_reload_is_an_error_ack_and_stays_asleep_until_a_retry(stage):
    model, control, folder = stage
    expected = model.weight.detach().clone()
    control.sleep(2)
    (folder / "model.safetensors").rename(folder / "moved.bin")
    ack = control.wake_up()
    assert ack.status == "ERROR" and "CheckpointError" in ack.error_msg
    assert control.is_sleeping and sorted(control.sleeping_tags) == ["kv_cache", "weights"]
    assert control.level == 2
    (folder / "moved.bin").rename(folder / "model.safetensors")
    assert control.wake_up().status == "SUCCESS"
    assert not control.is_sleeping and torch.equal(model.weight, expected)


def test_sleep_on_cuda_empties_the_torch_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(True))
    monkeypatch.setattr("omnistage.stage.sleep_control.device_used_bytes", lambda device: 0)
    arena = Arena("cuda:0", backend=HostBackend())  # a CUDA arena as far as the stage can tell
    arena.empty((1024,), torch.float32, "weights")
    control = SleepController(arena, 0, "unused", lambda path, strict, check_finite: None)
    control.sleep(0)
    assert not calls
    control.sleep(2)
    assert calls


def test_sleep_failing_half_way_is_an_error_ack_that_reports_what_went_down(tmp_path):
    from omnistage.memory import ArenaError, HostBackend

    class FlakyUnmap(HostBackend):
        calls = 0

        def unmap(self, region):
            FlakyUnmap.calls += 1
            if FlakyUnmap.calls == 2:
                raise ArenaError("unmap failed (injected)")
            super().unmap(region)

    model = nn.Linear(64, 64)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors")
    )
    expected = model.weight.detach().clone()
    arena = Arena("cpu", backend=FlakyUnmap())
    arena.adopt(model)
    arena.empty((1024,), torch.float32, "weights")  # a second region under the same tag
    control = SleepController(
        arena, 0, tmp_path, lambda p, strict, check_finite: load_module(model, p, strict=False)
    )
    ack = control.sleep(2)
    assert ack.status == "ERROR" and "injected" in ack.error_msg
    assert ack.metadata.sleeping_tags == ["weights"]
    assert control.wake_up().status == "SUCCESS"
    assert torch.equal(model.weight, expected)


def test_acks_carry_the_achieved_throughput(stage):
    _, control, _ = stage
    slept = control.sleep(1)
    assert slept.metadata.gbps > 0  # bytes offloaded over the arena's time
    woke = control.wake_up()
    assert woke.metadata.gbps > 0 and woke.metadata.reload_gbps == 0.0
    control.sleep(2)
    reloaded = control.wake_up()
    assert reloaded.metadata.reload_gbps > 0 and reloaded.metadata.gbps > 0


def test_a_reload_failing_half_way_is_rolled_back_and_the_next_wake_succeeds(stage, monkeypatch):
    from omnistage.errors import CheckpointError
    from omnistage.models import file_reader

    model, control, _ = stage
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    original = file_reader._read_exactly
    calls = {"n": 0}

    def flaky(span, start, into):
        calls["n"] += 1
        if calls["n"] == 2:  # the first tensor is already in place
            raise CheckpointError(f"tensor {span.name}: injected read failure")
        original(span, start, into)

    monkeypatch.setattr(file_reader, "_read_exactly", flaky)
    control.sleep(2)
    ack = control.wake_up()
    assert ack.status == "ERROR" and "injected read failure" in ack.error_msg
    assert control.is_sleeping and not control.weights_valid and control.level == 2
    monkeypatch.undo()
    assert control.wake_up().status == "SUCCESS"
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_an_offload_failing_half_way_leaves_the_stage_awake_and_serving(tmp_path, monkeypatch):
    model = nn.Linear(64, 64)
    expected = model.weight.detach().clone()
    arena = Arena("cpu")
    arena.adopt(model)
    arena.empty((1024,), torch.float32, "weights")  # a second region under the same tag
    control = SleepController(arena, 0, tmp_path, lambda p, strict, check_finite: 0)
    original = arena.backend.save
    calls = {"n": 0}

    def flaky(region):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("injected move failure")
        original(region)

    monkeypatch.setattr(arena.backend, "save", flaky)
    ack = control.sleep(1, tags=["weights"])
    assert ack.status == "ERROR" and "rolled back" in ack.error_msg
    assert not control.is_sleeping and control.weights_valid and control.level == 0
    control.check_can_generate()
    assert torch.equal(model.weight, expected)
    monkeypatch.undo()
    assert control.sleep(1, tags=["weights"]).status == "SUCCESS"
    assert control.wake_up().status == "SUCCESS"
    assert torch.equal(model.weight, expected)
