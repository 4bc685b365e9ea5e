"""Safetensors checkpoints straight into existing (arena-backed) tensors.

Each tensor's bytes are read from the file straight into its destination (``file_reader``:
``preadv`` on several threads, through pinned buffers to a device), or copied out of a memory
mapping of the file where the dtype changes on the way; no second full copy of the model is
ever held. Loading into tensors that already exist is also how level-2 wake works: the same
call refills the same addresses.

Checkpoint paths come from operators (``update_weights``), so nothing about a file is
trusted: only regular files are opened, the header is validated against the file's size
before any tensor is viewed, and every problem is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.file_reader import FileSpan, read_spans
from omnistage.models.finite import nonfinite_values

__all__ = ["CheckpointError", "LoadReport", "SafetensorsFile", "load_into", "load_module"]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_JSON_BYTES = 100 * 1024 * 1024  # headers and indexes; the safetensors library's limit
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; its bytes are known to lie inside the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offset of its first byte from the start of the file
    nbytes: int


@dataclass
class LoadReport:
    num_tensors: int = 0
    num_bytes: int = 0
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def shown(path: object) -> str:
    """``path`` for an error message: NUL bytes visible, very long paths shortened."""
    text = str(path).replace("\x00", "\\x00")
    return text if len(text) <= 240 else f"{text[:200]}...({len(text)} characters)"


def checkpoint_is_folder(path: str | Path) -> bool:
    """True for a folder, False for a regular file (following symlinks); anything else
    (missing, dangling link, device, FIFO, socket, unusable path) is a ``CheckpointError``."""
    if "\x00" in str(path):
        raise CheckpointError(f"checkpoint path contains a NUL byte: {shown(path)}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as exc:
        problem = "is a dangling symlink" if os.path.islink(path) else "does not exist"
        raise CheckpointError(f"checkpoint path {problem}: {shown(path)}") from exc
    except OSError as exc:  # ENAMETOOLONG, EACCES, ELOOP, ...
        raise CheckpointError(
            f"cannot access checkpoint path {shown(path)}: {exc.strerror}"
        ) from exc
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return stat.S_ISDIR(mode)
    kind = _KINDS.get(stat.S_IFMT(mode), "a socket or other special file")
    raise CheckpointError(f"checkpoint path {shown(path)} is {kind}, not a file or a folder")


def _open_regular(path: Path) -> tuple[int, int]:
    """``(fd, size)`` of a regular file. Nothing else is opened: reading a FIFO blocks forever
    and a device never ends. ``O_NONBLOCK`` keeps a FIFO swapped in after the check harmless."""
    if checkpoint_is_folder(path):
        raise CheckpointError(f"{shown(path)} is a folder, not a safetensors file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"cannot open {shown(path)}: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CheckpointError(f"{shown(path)} stopped being a regular file while opened")
    return fd, info.st_size


def _read_json(fd: int, offset: int, length: int, what: str) -> object:
    if length > _MAX_JSON_BYTES:
        raise CheckpointError(f"{what} is {length} bytes, over the {_MAX_JSON_BYTES} byte limit")
    try:
        data = os.pread(fd, length, offset)
    except OSError as exc:  # EIO
        raise CheckpointError(f"cannot read {what}: {exc.strerror}") from exc
    if len(data) != length:  # the file shrank, or it is a /sys file whose size is nominal
        raise CheckpointError(f"{what} is truncated: read {len(data)} of {length} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON; absurd nesting
        raise CheckpointError(f"{what} is not valid JSON: {exc}") from exc


def _parse_header(fd: int, size: int, path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The validated ``(entries, metadata)`` of the safetensors file open as ``fd``."""
    bad = f"{shown(path)} is not a safetensors file:"
    if size < 8:  # /proc files, /proc/self/mem included, have size 0 too
        raise CheckpointError(f"{bad} {'empty' if size == 0 else f'only {size} bytes'}")
    # A file that shrank since fstat reads short; padding makes that a too long header.
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\xff"))
    if header_len > size - 8:
        raise CheckpointError(f"{bad} header length {header_len} exceeds the {size}-byte file")
    header = _read_json(fd, 8, header_len, f"{bad} its header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad} its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{bad} __metadata__ is not an object of strings")
    data_start = 8 + header_len
    entries = {
        name: _entry(raw, data_start, size, f"{bad} tensor {shown(name)!r}")
        for name, raw in header.items()
    }
    return entries, metadata


def _entry(raw: object, data_start: int, size: int, bad: str) -> TensorEntry:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{bad} is a JSON {type(raw).__name__}, not an object")
    lacking = [key for key in ("dtype", "shape", "data_offsets") if key not in raw]
    if lacking:
        raise CheckpointError(f"{bad} lacks {lacking}")
    dtype_name, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(f"{bad} has unsupported dtype {shown(dtype_name)}")
    if not _ints(shape) or any(n < 0 for n in shape):
        raise CheckpointError(f"{bad} has shape {shown(shape)}, not a list of sizes")
    if not _ints(offsets) or len(offsets) != 2:
        raise CheckpointError(f"{bad} has data_offsets {shown(offsets)}, not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{bad} has negative or reversed data_offsets {offsets}")
    if data_start + end > size:
        raise CheckpointError(f"{bad} has data_offsets {offsets} beyond the end of the file")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            f"{bad} has {end - begin} bytes but shape {shape} of {dtype_name} needs {nbytes}"
        )
    return TensorEntry(dtype, tuple(shape), data_start + begin, nbytes)


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(n) is int for n in value)  # not bool, not float


def require_inside(folder: Path, file: Path) -> Path:
    """``file``, which an index named relative to ``folder``, if it stays inside ``folder``
    (by its spelling: symlinks inside, like a Hugging Face snapshot's, are the folder's own)."""
    depth = len(folder.parts)
    if (
        file.is_absolute() != folder.is_absolute()
        or file.parts[:depth] != folder.parts
        or len(file.parts) == depth
        or ".." in file.parts[depth:]
    ):
        raise CheckpointError(f"shard path {shown(file)} is not a file inside {shown(folder)}")
    return file


def index_files(index: Path) -> list[Path]:
    """The shard files a ``*.safetensors.index.json`` names in its ``weight_map``."""
    fd, size = _open_regular(index)
    try:
        parsed = _read_json(fd, 0, size, f"shard index {shown(index)}")
    finally:
        os.close(fd)
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"shard index {shown(index)} has no weight_map of names to files")
    names = dict.fromkeys(weight_map.values())
    return [require_inside(index.parent, index.parent / PurePath(name)) for name in names]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, an indexed folder, or a folder of shards."""
    p = Path(path)
    if not checkpoint_is_folder(p):
        return [p]
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if indexes:
        return index_files(indexes[0])
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {shown(p)}")
    return files


class SafetensorsFile:
    """A memory-mapped safetensors file whose tensors are zero-copy views of the mapping.

    The header is validated on opening (see ``TensorEntry``); the file stays open (``fd``, for
    reads straight into destinations: the file checked, not a path opened again) and mapped
    until ``close``. A failed opening leaves nothing open.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd, size = _open_regular(self.path)
        try:
            self.entries, self.metadata = _parse_header(fd, size, self.path)
            # ACCESS_COPY: writable for torch.frombuffer, never written back to the file.
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as exc:  # EIO, ENOMEM
            os.close(fd)
            raise CheckpointError(f"cannot read {shown(self.path)}: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8, offset=entry.start, count=entry.nbytes)
        return flat.view(entry.dtype).view(entry.shape)

    def span(self, key: str, dest: torch.Tensor, name: str) -> FileSpan | None:
        """The read of tensor ``key`` straight into ``dest``; None when bytes cannot go there
        as they are (another dtype, a non-contiguous destination)."""
        entry = self.entries[key]
        if dest.dtype != entry.dtype or not dest.is_contiguous() or entry.nbytes == 0:
            return None
        return FileSpan(self.fd, entry.start, entry.nbytes, dest, name)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def open_files(files: Iterable[Path]) -> Iterator[list[SafetensorsFile]]:
    """Map every file; all are closed on leaving the block, by error or not."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(SafetensorsFile(file)) for file in files]


@dataclass
class CopyPlan:
    """Checked copies ``(name, target, file, key)``, and the targets no tensor fills."""

    copies: list[tuple[str, torch.Tensor, SafetensorsFile, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def run(self) -> int:
        """Copy every planned tensor in place; returns the bytes written."""
        spans = []
        with torch.no_grad():
            for name, dest, st, key in self.copies:
                span = st.span(key, dest, name)
                if span is not None:
                    spans.append(span)
                else:
                    dest.copy_(st.tensor(key))  # converted; one mapped view alive at a time
            read_spans(spans)
        return sum(dest.numel() * dest.element_size() for _, dest, _, _ in self.copies)


def plan_copies(
    sources: Iterable[tuple[str | None, SafetensorsFile, str]],
    targets: Mapping[str, torch.Tensor],
    checkpoint: str | Path,
    *,
    strict: bool,
    check_finite: bool,
    hint: str = "",
) -> CopyPlan:
    """Match ``(target name or None to skip, file, key)`` to ``targets``; copy nothing.

    ``CheckpointError`` for: no tensors, an unknown name (``hint`` says how names are
    spelled), a name twice, a shape mismatch, a missing target with ``strict`` (one sharing
    memory with a loaded target, a tied weight, counts as loaded), nothing to load, and with
    ``check_finite`` values that are, or would become in the target's dtype, NaN or Inf.
    """
    where, plan, count = shown(checkpoint), CopyPlan(), 0
    unexpected: list[str] = []
    seen: dict[str, Path] = {}
    for name, st, key in sources:
        count += 1
        if name is None:
            continue
        dest = targets.get(name)
        if dest is None:
            unexpected.append(name)
            continue
        if name in seen:
            raise CheckpointError(f"{where}: tensor {name} is both in {seen[name]} and {st.path}")
        seen[name] = st.path
        if tuple(dest.shape) != st.entries[key].shape:
            raise CheckpointError(
                f"shape mismatch for {name}: checkpoint {st.entries[key].shape}, "
                f"model {tuple(dest.shape)}"
            )
        plan.copies.append((name, dest, st, key))
    if count == 0:
        raise CheckpointError(f"checkpoint {where} contains no tensors")
    if unexpected:
        raise CheckpointError(
            f"checkpoint {where} has tensors the model does not: {_few(unexpected)}{hint}"
        )
    loaded = {dest.data_ptr() for _, dest, _, _ in plan.copies}
    plan.missing = [name for name, t in targets.items() if t.data_ptr() not in loaded]
    if strict and plan.missing:
        raise CheckpointError(
            f"checkpoint {where} lacks tensors of the model: {_few(plan.missing)}"
        )
    if not plan.copies:
        raise CheckpointError(f"none of the {count} tensors of {where} belong to this model")
    if check_finite:
        for name, dest, st, key in plan.copies:
            problem = nonfinite_values(st.tensor(key), dest.dtype)
            if problem:
                raise CheckpointError(f"tensor {name} of {where} has {problem}")
    return plan


def _few(names: list[str]) -> str:
    return f"{[shown(n) for n in names[:8]]}{'...' if len(names) > 8 else ''}"


def load_into(
    targets: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    rename: Callable[[str], str | None] | None = None,
    strict: bool = True,
    check_finite: bool = False,
) -> LoadReport:
    """Copy a checkpoint's tensors into ``targets`` in place (addresses do not change).

    ``rename`` maps a checkpoint name to a target name (``None`` skips it). Raises
    ``CheckpointError`` as ``plan_copies`` says (a missing tensor only with ``strict``: a
    partial update may leave tensors out; non-finite values only with ``check_finite``).
    Every check runs before the first copy, so a checkpoint that does not fit leaves the
    targets as they were: an update of live weights never half-applies, nor passes for a
    success having loaded nothing.
    """
    files = checkpoint_files(path)
    with open_files(files) as opened:
        sources = [
            (rename(key) if rename is not None else key, st, key)
            for st in opened
            for key in st.keys()  # noqa: SIM118 - not a dict
        ]
        plan = plan_copies(sources, targets, path, strict=strict, check_finite=check_finite)
        num_bytes = plan.run()
    return LoadReport(len(plan.copies), num_bytes, [str(f) for f in files], plan.missing)


def module_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and persistent buffers by state-dict name, as live tensors."""
    return {
        name: t.data if isinstance(t, nn.Parameter) else t
        for name, t in module.state_dict(keep_vars=True).items()
    }


def load_module(
    module: nn.Module,
    path: str | Path,
    *,
    rename: Callable[[str], str | None] | None = None,
    strict: bool = True,
    check_finite: bool = False,
) -> LoadReport:
    """Load a checkpoint into a module's existing tensors in place (see ``load_into``)."""
    return load_into(
        module_targets(module), path, rename=rename, strict=strict, check_finite=check_finite
    )
