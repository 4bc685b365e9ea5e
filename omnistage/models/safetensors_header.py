"""The header of a safetensors file, validated against the file before any tensor is read.

Checkpoint paths come from operators (``update_weights``), so nothing about a file is
trusted: only regular files are opened, the header is validated against the file's size
before any tensor is viewed, and every problem is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.errors import CheckpointError

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


def open_regular(path: Path) -> tuple[int, int]:
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


def read_json(fd: int, offset: int, length: int, what: str) -> object:
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


def parse_header(fd: int, size: int, path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The validated ``(entries, metadata)`` of the safetensors file open as ``fd``."""
    bad = f"{shown(path)} is not a safetensors file:"
    if size < 8:  # /proc files, /proc/self/mem included, have size 0 too
        raise CheckpointError(f"{bad} {'empty' if size == 0 else f'only {size} bytes'}")
    # A file that shrank since fstat reads short; padding makes that a too long header.
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\xff"))
    if header_len > size - 8:
        raise CheckpointError(f"{bad} header length {header_len} exceeds the {size}-byte file")
    header = read_json(fd, 8, header_len, f"{bad} its header")
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
