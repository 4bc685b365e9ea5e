"""Safetensors checkpoints straight into existing (arena-backed) tensors.

Each tensor's bytes are read from the file straight into its destination (``file_reader``:
``preadv`` on several threads, through pinned buffers to a device), or copied out of a memory
mapping of the file where the dtype changes on the way; no second full copy of the model is
ever held. Loading into tensors that already exist is also how level-2 wake works: the same
call refills the same addresses.

Checkpoint paths come from operators (``update_weights``), so nothing about a file is
trusted (``safetensors_header``): every problem is a ``CheckpointError`` naming it.

A tensor-parallel rank loads only its slice of each sharded tensor (``shards``: target name →
``Shard``); a slice of whole rows is read straight from the file like a whole tensor.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.file_reader import FileSpan, read_spans
from omnistage.models.finite import nonfinite_values
from omnistage.models.safetensors_header import (
    TensorEntry,
    checkpoint_is_folder,
    open_regular,
    parse_header,
    read_json,
    shown,
)
from omnistage.models.tensor_parallel import Shard, shards_of

__all__ = [
    "CheckpointError",
    "LoadReport",
    "SafetensorsFile",
    "TensorEntry",
    "checkpoint_is_folder",
    "load_into",
    "load_module",
    "shown",
]


@dataclass
class LoadReport:
    num_tensors: int = 0
    num_bytes: int = 0
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


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
    fd, size = open_regular(index)
    try:
        parsed = read_json(fd, 0, size, f"shard index {shown(index)}")
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


_HEADERS: OrderedDict[tuple[int, ...], tuple[dict[str, TensorEntry], dict[str, str]]] = (
    OrderedDict()
)
_MAX_HEADERS = 64
_headers_lock = threading.Lock()


def _checked_header(
    fd: int, size: int, path: Path
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """``parse_header``, remembered per file as it is on disk (device, inode, size and
    modification time): a level-2 reload opens the same unchanged files on every wake, and
    a header of thousands of tensors takes milliseconds to check again."""
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino, size, info.st_mtime_ns)
    with _headers_lock:
        found = _HEADERS.get(key)
        if found is not None:
            _HEADERS.move_to_end(key)
            return found
    found = parse_header(fd, size, path)
    with _headers_lock:
        _HEADERS[key] = found
        if len(_HEADERS) > _MAX_HEADERS:
            _HEADERS.popitem(last=False)
    return found


class SafetensorsFile:
    """A memory-mapped safetensors file whose tensors are zero-copy views of the mapping.

    The header is validated on opening (see ``TensorEntry``); the file stays open (``fd``, for
    reads straight into destinations: the file checked, not a path opened again) and mapped
    until ``close``. A failed opening leaves nothing open.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd, size = open_regular(self.path)
        try:
            self.entries, self.metadata = _checked_header(fd, size, self.path)
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

    def span(
        self, key: str, dest: torch.Tensor, name: str, shard: Shard | None = None
    ) -> FileSpan | None:
        """The read of tensor ``key`` (or its ``shard``: whole rows only) straight into
        ``dest``; None when bytes cannot go there as they are (another dtype, a column slice,
        a non-contiguous destination)."""
        entry = self.entries[key]
        if dest.dtype != entry.dtype or not dest.is_contiguous() or entry.nbytes == 0:
            return None
        if shard is None:
            return FileSpan(self.fd, entry.start, entry.nbytes, dest, name)
        if shard.dim != 0 or not entry.shape:
            return None
        row = entry.nbytes // entry.shape[0]
        return FileSpan(self.fd, entry.start + shard.start * row, shard.length * row, dest, name)

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


Copy = tuple[str, torch.Tensor, SafetensorsFile, str, Shard | None]


def source_of(st: SafetensorsFile, key: str, shard: Shard | None) -> torch.Tensor:
    """A checkpoint tensor (a mapped view), or the slice of it ``shard`` names."""
    tensor = st.tensor(key)
    return tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.length)


@dataclass
class CopyPlan:
    """Checked copies ``(name, target, file, key, shard)`` — ``target`` already narrowed to
    what the shard fills — and the targets no tensor fills."""

    copies: list[Copy] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def run(self) -> int:
        """Copy every planned tensor in place; returns the bytes written."""
        spans = []
        with torch.no_grad():
            for name, dest, st, key, shard in self.copies:
                span = st.span(key, dest, name, shard)
                if span is not None:
                    spans.append(span)
                else:  # converted or a column slice; one mapped view alive at a time
                    dest.copy_(source_of(st, key, shard))
            read_spans(spans)
        return sum(dest.numel() * dest.element_size() for _, dest, _, _, _ in self.copies)


def plan_copies(
    sources: Iterable[tuple[str | None, SafetensorsFile, str]],
    targets: Mapping[str, torch.Tensor],
    checkpoint: str | Path,
    *,
    strict: bool,
    check_finite: bool,
    hint: str = "",
    shards: Mapping[str, Shard] | None = None,
) -> CopyPlan:
    """Match ``(target name or None to skip, file, key)`` to ``targets``; copy nothing.
    A target named in ``shards`` takes that slice of its checkpoint tensor.

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
        shape, shard = st.entries[key].shape, (shards or {}).get(name)
        if shard is not None:
            if shard.dim >= len(shape) or shard.start + shard.length > shape[shard.dim]:
                raise CheckpointError(
                    f"shape mismatch for {name}: checkpoint {shape} has no slice "
                    f"[{shard.start}, {shard.start + shard.length}) along dimension {shard.dim}"
                )
            shape = (*shape[: shard.dim], shard.length, *shape[shard.dim + 1 :])
            if shard.dim < dest.dim():
                dest = dest.narrow(shard.dim, 0, min(shard.length, dest.shape[shard.dim]))
        if tuple(dest.shape) != shape:
            raise CheckpointError(
                f"shape mismatch for {name}: checkpoint {shape}, model {tuple(dest.shape)}"
            )
        plan.copies.append((name, dest, st, key, shard))
    if count == 0:
        raise CheckpointError(f"checkpoint {where} contains no tensors")
    if unexpected:
        raise CheckpointError(
            f"checkpoint {where} has tensors the model does not: {_few(unexpected)}{hint}"
        )
    loaded = {dest.data_ptr() for _, dest, _, _, _ in plan.copies}
    plan.missing = [name for name, t in targets.items() if t.data_ptr() not in loaded]
    if strict and plan.missing:
        raise CheckpointError(
            f"checkpoint {where} lacks tensors of the model: {_few(plan.missing)}"
        )
    if not plan.copies:
        raise CheckpointError(f"none of the {count} tensors of {where} belong to this model")
    if check_finite:
        for name, dest, st, key, shard in plan.copies:
            problem = nonfinite_values(source_of(st, key, shard), dest.dtype)
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
    shards: Mapping[str, Shard] | None = None,
    hint: str = "",
) -> LoadReport:
    """Copy a checkpoint's tensors into ``targets`` in place (addresses do not change).

    ``rename`` maps a checkpoint name to a target name (``None`` skips it); ``shards`` names
    the targets that take a slice of their tensor (a tensor-parallel rank's). Raises
    ``CheckpointError`` as ``plan_copies`` says (a missing tensor only with ``strict``: a
    partial update may leave tensors out; non-finite values only with ``check_finite``;
    ``hint`` follows the message of unknown names).
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
        plan = plan_copies(
            sources,
            targets,
            path,
            strict=strict,
            check_finite=check_finite,
            hint=hint,
            shards=shards,
        )
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
    """Load a checkpoint into a module's existing tensors in place (see ``load_into``); a
    tensor-parallel module's parameters take their rank's slices (``shards_of``)."""
    return load_into(
        module_targets(module),
        path,
        rename=rename,
        strict=strict,
        check_finite=check_finite,
        shards=shards_of(module) or None,
    )
