"""Hostile checkpoints: every one is a ``CheckpointError`` naming the problem, raised before
anything is copied (targets unchanged), without hanging, and leaving no file open or mapped."""

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from omnistage.models.loader import CheckpointError, load_module

F32_BIAS = {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}  # fits model's "1.bias"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16))


def raw_file(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file built by hand: 8-byte length, JSON header (or raw bytes), data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + text + data)
    return path


Build = Callable[[Path], Path]  # makes the checkpoint in a temporary folder, returns its path


def header(value: object, data: bytes = b"", header_len: int | None = None) -> Build:
    return lambda tmp: raw_file(tmp / "m.safetensors", value, data, header_len)


def entry(data: bytes = bytes(64), **changes: object) -> Build:
    """One tensor for the model's ``1.bias`` (16 float32), with ``changes`` to its entry."""
    return header({"1.bias": {**F32_BIAS, **changes}}, data)


def raw_bytes(data: bytes) -> Build:
    def build(tmp: Path) -> Path:
        (tmp / "m.safetensors").write_bytes(data)
        return tmp / "m.safetensors"

    return build


def tensors(state: dict[str, torch.Tensor], file: str = "m.safetensors") -> Build:
    def build(tmp: Path) -> Path:
        save_file(state, str(tmp / file))
        return tmp / file

    return build


def index(weight_map: object = None, text: str | None = None) -> Build:
    """A folder with one shard holding ``1.bias`` and an index naming shards."""

    def build(tmp: Path) -> Path:
        save_file({"1.bias": torch.ones(16)}, str(tmp / "shard.safetensors"))
        index_text = text if text is not None else json.dumps({"weight_map": weight_map})
        (tmp / "model.safetensors.index.json").write_text(index_text)
        return tmp

    return build


def escaping(tmp: Path) -> Path:
    """An index naming ``../outside.safetensors``, a good file: only containment stops it."""
    save_file({"1.bias": torch.ones(16)}, str(tmp / "outside.safetensors"))
    (tmp / "ckpt").mkdir()
    return index({"1.bias": "../outside.safetensors"})(tmp / "ckpt")


def fifo(name: str = "pipe.safetensors") -> Build:
    def build(tmp: Path) -> Path:
        os.mkfifo(tmp / name)
        return tmp / name if name.endswith(".safetensors") else tmp

    return build


def dangling(tmp: Path) -> Path:
    (tmp / "link.safetensors").symlink_to(tmp / "gone.safetensors")
    return tmp / "link.safetensors"


def symlink_loop(tmp: Path) -> Path:
    (tmp / "a.safetensors").symlink_to(tmp / "b.safetensors")
    (tmp / "b.safetensors").symlink_to(tmp / "a.safetensors")
    return tmp / "a.safetensors"


def shard_is_a_folder(tmp: Path) -> Path:
    (tmp / "a.safetensors").mkdir()
    return tmp


def same_tensor_twice(tmp: Path) -> Path:
    save_file({"1.bias": torch.ones(16)}, str(tmp / "a.safetensors"))
    save_file({"1.bias": torch.zeros(16)}, str(tmp / "b.safetensors"))
    return tmp


def system(path: str) -> Build:
    def build(tmp: Path) -> Path:
        if not os.path.exists(path):
            pytest.skip(f"{path} is not on this system")
        return Path(path)

    return build


def long_path(tmp: Path) -> Path:
    return tmp / ("x" * 100_000)


def nul_path(tmp: Path) -> Path:
    return Path(f"{tmp}/m\x00.safetensors")


# (id, build, what the message must say)
CASES: list[tuple[str, Build, str]] = [
    ("etc-passwd", system("/etc/passwd"), r"not a safetensors file: header length \d+ exceeds"),
    ("folder-without-safetensors", lambda tmp: tmp, r"no \*\.safetensors files"),
    ("proc-self-mem", system("/proc/self/mem"), r"not a safetensors file: empty"),
    ("dev-zero", system("/dev/zero"), r"/dev/zero is a device"),
    ("fifo", fifo(), r"pipe\.safetensors is a FIFO"),
    ("fifo-as-index", fifo("model.safetensors.index.json"), r"index\.json is a FIFO"),
    ("dangling-symlink", dangling, r"dangling symlink: .*link\.safetensors"),
    ("symlink-loop", symlink_loop, r"Too many levels of symbolic links"),
    ("shard-is-a-folder", shard_is_a_folder, r"is a folder, not a safetensors file"),
    ("empty-file", raw_bytes(b""), r"not a safetensors file: empty"),
    ("shorter-than-8-bytes", raw_bytes(b"\x05\x00"), r"not a safetensors file: only 2 bytes"),
    ("bad-json-header", header(b"{not json"), r"header is not valid JSON"),
    ("bad-utf8-header", header(b'{"\xff": 1}'), r"header is not valid JSON"),
    ("deeply-nested-header", header(b"[" * 200_000), r"header is not valid JSON"),
    ("header-not-an-object", header([1, 2]), r"header is a JSON list, not an object"),
    ("entry-not-an-object", header({"1.bias": 5}), r"tensor '1\.bias' is a JSON int"),
    (
        "entry-lacks-keys",
        header({"1.bias": {"dtype": "F32"}}),
        r"lacks \['shape', 'data_offsets'\]",
    ),
    ("dtype-not-a-string", entry(dtype=4), r"'1\.bias' has unsupported dtype 4"),
    ("unsupported-dtype", entry(dtype="C64"), r"'1\.bias' has unsupported dtype C64"),
    ("shape-not-a-list", entry(shape="16"), r"shape 16, not a list of sizes"),
    ("shape-negative", entry(shape=[-16]), r"shape \[-16\], not a list of sizes"),
    ("shape-of-floats", entry(shape=[16.0]), r"shape \[16\.0\], not a list of sizes"),
    ("offsets-not-a-pair", entry(data_offsets=[0]), r"data_offsets \[0\], not \[begin, end\]"),
    ("offsets-of-bools", entry(data_offsets=[False, True]), r"not \[begin, end\]"),
    ("offsets-negative", entry(data_offsets=[-64, 0]), r"negative or reversed data_offsets"),
    ("offsets-reversed", entry(data_offsets=[64, 0]), r"negative or reversed data_offsets"),
    ("offsets-past-the-end", entry(data=bytes(32)), r"\[0, 64\] beyond the end of the file"),
    ("offsets-huge", entry(data_offsets=[2**70, 2**70 + 64]), r"beyond the end of the file"),
    (
        "bytes-not-shape-x-dtype",
        entry(data_offsets=[0, 60]),
        r"60 bytes but shape \[16\] of F32 needs 64",
    ),
    ("header-longer-than-file", header({}, header_len=10**6), r"header length 1000000 exceeds"),
    ("metadata-not-strings", header({"__metadata__": {"a": 1}}), r"__metadata__ is not"),
    ("index-malformed", index(text="{"), r"shard index .* is not valid JSON"),
    ("index-without-weight-map", index(text="{}"), r"no weight_map"),
    ("weight-map-not-a-dict", index(["shard.safetensors"]), r"no weight_map"),
    ("weight-map-not-str-to-str", index({"1.bias": 1}), r"no weight_map"),
    ("index-names-missing-shard", index({"1.bias": "gone.safetensors"}), r"does not exist: .*gone"),
    ("index-escapes-the-folder", escaping, r"outside\.safetensors is not a file inside"),
    ("index-absolute-path", index({"1.bias": "/etc/passwd"}), r"/etc/passwd is not a file inside"),
    ("index-empty-name", index({"1.bias": ""}), r"is not a file inside"),
    ("path-100k-characters", long_path, r"File name too long"),
    ("path-with-nul-byte", nul_path, r"contains a NUL byte: .*m\\x00"),
    ("wrong-shape", tensors({"1.bias": torch.ones(8)}), r"shape mismatch for 1\.bias"),
    ("unknown-key", tensors({"module.1.bias": torch.ones(16)}), r"does not: \['module\.1\.bias'\]"),
    ("tensor-in-two-shards", same_tensor_twice, r"1\.bias is both in"),
    ("zero-tensors", header({}), r"contains no tensors"),
    ("zero-tensors-only-metadata", header({"__metadata__": {}}), r"contains no tensors"),
]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def mapped_under(folder: Path) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(folder) in line]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("build", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_checkpoint_is_a_named_checkpoint_error_and_changes_nothing(
    tmp_path, build, message
):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = build(tmp_path)
    fds = open_fds()
    with pytest.raises(CheckpointError, match=message) as caught:
        load_module(model, path, strict=False, check_finite=True)
    assert type(caught.value) is CheckpointError
    assert len(str(caught.value)) < 2000  # a 100 000-character path is not echoed whole
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert open_fds() <= fds
    assert mapped_under(tmp_path) == []


@pytest.mark.timeout(10)
def test_nothing_kept_after_renaming_is_an_error(tmp_path):
    save_file({"1.bias": torch.ones(16)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match="none of the 1 tensors .* belong to this model"):
        load_module(make_model(), tmp_path, strict=False, rename=lambda name: None)


def with_bad_values(model: nn.Module, values: list[float]) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["1.weight"].view(-1)[: len(values)] = torch.tensor(values)
    return state


@pytest.mark.timeout(10)
def test_non_finite_values_are_refused_with_check_finite_and_taken_without(tmp_path):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = tmp_path / "update.safetensors"
    save_file(with_bad_values(model, [float("nan"), float("inf"), -float("inf")]), str(update))
    with pytest.raises(CheckpointError, match=r"tensor 1\.weight .* has 3 non-finite"):
        load_module(model, update, check_finite=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert mapped_under(tmp_path) == []
    load_module(model, update, check_finite=False)
    assert int((~torch.isfinite(model[1].weight)).sum()) == 3


@pytest.mark.timeout(10)
def test_values_that_overflow_a_narrower_target_are_refused(tmp_path):
    model = make_model().half()
    save_file(with_bad_values(make_model(), [1e6, -7e4]), str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"2 values beyond the range of torch\.float16"):
        load_module(model, tmp_path, check_finite=True)


@pytest.mark.timeout(10)
def test_float8_and_integer_sources_are_checked_or_skipped(tmp_path):
    model = nn.Linear(4, 4)
    weight = torch.tensor([[1.0, float("nan"), 2.0, 3.0]] * 4).to(torch.float8_e4m3fn)
    save_file({"weight": weight, "bias": torch.arange(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor weight .* has 4 non-finite"):
        load_module(model, tmp_path, check_finite=True)
    save_file(
        {"weight": torch.ones(4, 4), "bias": torch.arange(4)}, str(tmp_path / "m.safetensors")
    )
    load_module(model, tmp_path, check_finite=True)
    assert torch.equal(model.bias, torch.arange(4.0))


# -- the diffusion pipeline's own entry point -------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from omnistage.memory import Arena
    from omnistage.models.diffusion.pipeline import LoadedPipeline
    from omnistage.models.tiny import build_preset

    folder = build_preset("image", tmp_path_factory.mktemp("image"))
    return LoadedPipeline(folder, Arena("cpu"))


def weights_of(pipeline) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": t.detach().clone()
        for name, module in pipeline.modules.items()
        for key, t in module.state_dict().items()
    }


def unchanged(pipeline, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[k]) for k, t in weights_of(pipeline).items())


def pipeline_folder(weight_map: dict) -> Build:
    """A pipeline folder whose transformer shard index names ``weight_map``'s files."""

    def build(tmp: Path) -> Path:
        model_index = {"transformer": ["diffusers", "PixArtTransformer2DModel"]}
        (tmp / "model_index.json").write_text(json.dumps(model_index))
        (tmp / "transformer").mkdir()
        shard_index = tmp / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
        shard_index.write_text(json.dumps({"weight_map": weight_map}))
        return tmp

    return build


PIPELINE_CASES: list[tuple[str, Build, str]] = [
    ("not-safetensors", system("/etc/passwd"), r"neither a diffusers pipeline folder"),
    ("dev-zero", system("/dev/zero"), r"is a device"),
    ("fifo", fifo(), r"is a FIFO"),
    ("dangling-symlink", dangling, r"dangling symlink"),
    ("path-100k-characters", long_path, r"File name too long"),
    ("path-with-nul-byte", nul_path, r"NUL byte"),
    ("folder-without-model-index", lambda tmp: tmp, r"no model_index\.json"),
    (
        "index-escapes-component",
        pipeline_folder({"w": "../../x.safetensors"}),
        r"not a file inside",
    ),
    ("index-absolute-path", pipeline_folder({"w": "/etc/passwd"}), r"not a file inside"),
    ("bad-header", raw_bytes(struct.pack("<Q", 2) + b"{x"), r"header is not valid JSON"),
    ("zero-tensors", header({}), r"contains no tensors"),
    ("unknown-key", tensors({"proj_out.weight": torch.ones(1)}), r"'<component>\.<tensor>'"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("build", "message"), [c[1:] for c in PIPELINE_CASES], ids=[c[0] for c in PIPELINE_CASES]
)
def test_hostile_sources_for_the_image_pipeline(pipeline, tmp_path, build, message):
    before = weights_of(pipeline)
    path = build(tmp_path)
    fds = open_fds()
    with pytest.raises(CheckpointError, match=message):
        pipeline.load_weights(path, strict=False, check_finite=True)
    assert unchanged(pipeline, before)
    assert open_fds() <= fds
    assert mapped_under(tmp_path) == []


@pytest.mark.timeout(10)
def test_image_pipeline_non_finite_update_is_refused_with_check_finite(pipeline, tmp_path):
    before = weights_of(pipeline)
    weight = pipeline.module("transformer").proj_out.weight.detach().clone()
    weight.view(-1)[:2] = float("nan")
    update = tmp_path / "update.safetensors"
    save_file({"transformer.proj_out.weight": weight}, str(update))
    with pytest.raises(CheckpointError, match=r"transformer\.proj_out\.weight .* has 2 non-finite"):
        pipeline.load_weights(update, strict=False, check_finite=True)
    assert unchanged(pipeline, before)
    assert mapped_under(tmp_path) == []
    pipeline.load_weights(update, strict=False, check_finite=False)
    assert int(torch.isnan(pipeline.module("transformer").proj_out.weight).sum()) == 2
    pipeline.load_weights(pipeline.folder, strict=True, check_finite=True)  # put back, checked
    assert unchanged(pipeline, before)
