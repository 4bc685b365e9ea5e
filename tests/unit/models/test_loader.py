import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from omnistage.memory import Arena
from omnistage.models.loader import CheckpointError, checkpoint_files, load_into, load_module


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16))
    model.register_buffer("scale", torch.tensor([2.0]))
    return model


def save_sharded(model: nn.Module, folder) -> None:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def test_sharded_checkpoint_loads_into_meta_built_arena_module(tmp_path):
    source = make_model()
    save_sharded(source, tmp_path)
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    with torch.device("meta"):
        target = make_model()
    arena = Arena("cpu")
    arena.adopt(target)
    ptrs = [p.data_ptr() for p in target.state_dict().values()]
    report = load_module(target, tmp_path)
    assert report.num_tensors == len(source.state_dict())
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    load_module(target, tmp_path)  # reload lands in the same memory
    assert [p.data_ptr() for p in target.state_dict().values()] == ptrs


def test_dtype_is_converted_on_copy(tmp_path):
    model = make_model()
    save_file(
        {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in model.state_dict().items()
        },
        str(tmp_path / "m.safetensors"),
    )
    load_module(model, tmp_path)
    assert model[1].weight.dtype == torch.float32


def test_shape_mismatch_names_the_tensor(tmp_path):
    model = make_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["1.weight"] = torch.zeros(8, 16)
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"1\.weight"):
        load_module(model, tmp_path)


def test_missing_tensor_is_reported(tmp_path):
    model = make_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "2.bias"}
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"2\.bias"):
        load_module(model, tmp_path)
    assert load_module(model, tmp_path, strict=False).missing == ["2.bias"]


def test_tied_weights_count_as_loaded(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    save_file({"embed.weight": torch.ones(8, 4)}, str(tmp_path / "m.safetensors"))
    load_module(model, tmp_path)
    assert torch.all(model.head.weight == 1)


def test_missing_path_and_garbage_file_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_files(tmp_path / "nope")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_module(make_model(), tmp_path)


def test_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = {"0.weight": torch.ones(32, 16), "1.weight": torch.ones(8, 16)}  # 1.weight: bad shape
    save_file(update, str(tmp_path / "update.safetensors"))
    with pytest.raises(CheckpointError, match=r"1\.weight"):
        load_module(model, tmp_path / "update.safetensors", strict=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_partial_update_with_unknown_names_is_refused(tmp_path):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = {"0.weight": torch.ones(32, 16), "module.1.weight": torch.ones(16, 16)}
    save_file(update, str(tmp_path / "update.safetensors"))
    with pytest.raises(CheckpointError, match=r"module\.1\.weight"):
        load_module(model, tmp_path / "update.safetensors", strict=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_every_supported_dtype_and_an_empty_tensor_round_trip(tmp_path):
    torch.manual_seed(0)
    state = {
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "f32": torch.randn(5),
        "f16": torch.randn(4).half(),
        "bf16": torch.randn(4).bfloat16(),
        "f8e4m3": torch.randn(4).to(torch.float8_e4m3fn),
        "f8e5m2": torch.randn(4).to(torch.float8_e5m2),
        "i64": torch.arange(3),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-1, 2, dtype=torch.int8),
        "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
    }
    save_file(state, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    report = load_into(targets, tmp_path / "m.safetensors", check_finite=True)
    assert report.num_tensors == len(state)
    for name, value in state.items():
        assert torch.equal(targets[name].view(torch.uint8), value.view(torch.uint8)), name


def test_tensor_data_need_not_be_aligned(tmp_path):
    values = torch.arange(4, dtype=torch.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}) + " "
    assert (8 + len(header)) % 4 != 0
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + values.numpy().tobytes())
    target = {"w": torch.zeros(4)}
    load_into(target, path)
    assert torch.equal(target["w"], values)


def test_index_shards_may_be_symlinks_out_of_the_folder_or_in_a_subfolder(tmp_path):
    """A Hugging Face snapshot links each shard to ``../../blobs/<hash>``: the index names a
    file inside the folder, and where the link leads is the folder owner's choice."""
    model = make_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "blobs").mkdir()
    snapshot = tmp_path / "snapshots" / "abc"
    (snapshot / "sub").mkdir(parents=True)
    names = sorted(state)
    save_file({k: state[k] for k in names[:2]}, str(tmp_path / "blobs" / "1234"))
    (snapshot / "a.safetensors").symlink_to("../../blobs/1234")
    save_file({k: state[k] for k in names[2:]}, str(snapshot / "sub" / "b.safetensors"))
    weight_map = {k: "a.safetensors" for k in names[:2]}
    weight_map |= {k: "sub/b.safetensors" for k in names[2:]}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    target = make_model()
    for t in target.state_dict().values():
        t.zero_()
    assert load_module(target, snapshot).num_tensors == len(state)
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())


def test_finite_weights_pass_the_check_and_report_what_they_copied(tmp_path):
    model = make_model()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors")
    )
    report = load_module(make_model(), tmp_path, check_finite=True)
    assert report.num_bytes == sum(
        v.numel() * v.element_size() for v in model.state_dict().values()
    )
    assert report.files == [str(tmp_path / "m.safetensors")] and report.missing == []


def test_an_unchanged_file_is_checked_once_and_a_changed_one_again(tmp_path, monkeypatch):
    from omnistage.models import loader

    parsed = []
    real = loader.parse_header
    monkeypatch.setattr(loader, "parse_header", lambda *a: parsed.append(a[2]) or real(*a))
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(8)}, str(path))
    targets = {"w": torch.zeros(8)}
    load_into(targets, path)
    load_into(targets, path)
    assert len(parsed) == 1  # a reload of the same file reads its header once
    save_file({"w": torch.full((8,), 3.0), "extra": torch.zeros(1)}, str(path))
    with pytest.raises(CheckpointError, match="extra"):
        load_into(targets, path)
    assert len(parsed) == 2
