"""Safetensors checkpoints straight into existing (arena-backed) tensors.

The file is memory-mapped and each tensor is copied from the mapping into its destination,
so no second full copy of the model is ever held. Loading into tensors that already exist is
also how level-2 wake works: the same call refills the same addresses.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

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


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the model."""


@dataclass
class LoadReport:
    num_tensors: int = 0
    num_bytes: int = 0
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, an indexed folder, or a folder of shards."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path does not exist: {p}")
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [p / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {p}")
    return files


class SafetensorsFile:
    """A memory-mapped safetensors file whose tensors are zero-copy views of the mapping."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                # ACCESS_COPY: writable for torch.frombuffer, never written back to the file.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError as exc:  # empty file
                raise CheckpointError(f"{self.path} is not a safetensors file: {exc}") from exc
        try:
            (header_len,) = struct.unpack("<Q", self._mm[:8])
            header = json.loads(self._mm[8 : 8 + header_len])
        except (struct.error, ValueError) as exc:
            self._mm.close()
            raise CheckpointError(f"{self.path} is not a safetensors file: {exc}") from exc
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict] = header
        self._data_start = 8 + header_len

    def keys(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: unsupported dtype {entry['dtype']} for {name}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self._mm, dtype=torch.uint8, offset=self._data_start + begin, count=end - begin
        )  # type: ignore[call-overload]
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._mm.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint, one mapped view at a time."""
    for file in checkpoint_files(path):
        with SafetensorsFile(file) as st:
            for name in st.keys():  # noqa: SIM118 - not a dict
                yield name, st.tensor(name)


def load_into(
    targets: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    rename: Callable[[str], str | None] | None = None,
    strict: bool = True,
) -> LoadReport:
    """Copy a checkpoint's tensors into ``targets`` in place (addresses do not change).

    ``rename`` maps a checkpoint name to a target name (``None`` skips it). Targets that share
    memory with a loaded tensor (tied weights) count as loaded. A missing tensor raises
    ``CheckpointError`` with ``strict`` (a partial update may leave tensors out); an
    unexpected tensor or a shape mismatch always does. Every check runs before the first
    copy, so a checkpoint that does not fit leaves the targets as they were: an update of
    live weights never half-applies, nor passes for a success having loaded nothing.
    """
    report = LoadReport(files=[str(f) for f in checkpoint_files(path)])
    loaded_ptrs: set[int] = set()
    for name, key, dest, src in _matches(targets, path, rename):
        if dest is None:
            report.unexpected.append(name)
            continue
        if tuple(dest.shape) != tuple(src.shape):
            raise CheckpointError(
                f"shape mismatch for {key}: checkpoint {tuple(src.shape)}, model {tuple(dest.shape)}"
            )
        loaded_ptrs.add(dest.data_ptr())
    report.missing = [k for k, t in targets.items() if t.data_ptr() not in loaded_ptrs]
    missing = report.missing if strict else []
    if missing or report.unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {report.unexpected[:8]}"
            f"{'...' if len(report.unexpected) > 8 else ''}"
        )
    with torch.no_grad():
        for _, _, dest, src in _matches(targets, path, rename):
            if dest is not None:
                dest.copy_(src)
                report.num_tensors += 1
                report.num_bytes += dest.numel() * dest.element_size()
    return report


def _matches(
    targets: Mapping[str, torch.Tensor],
    path: str | Path,
    rename: Callable[[str], str | None] | None,
) -> Iterator[tuple[str, str, torch.Tensor | None, torch.Tensor]]:
    """``(name, key, target or None, mapped tensor)`` for each checkpoint tensor not skipped."""
    for name, src in iter_checkpoint(path):
        key = rename(name) if rename is not None else name
        if key is not None:
            yield name, key, targets.get(key), src


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
) -> LoadReport:
    """Load a checkpoint into a module's existing tensors in place."""
    return load_into(module_targets(module), path, rename=rename, strict=strict)
