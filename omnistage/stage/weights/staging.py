"""Host staging of a trainer's weight update: one buffer per tensor of an update, in a
*set* laid out once per layout (names, dtypes, shapes) and reused from update to update.

On a host stage (and on every tensor-parallel stage) a set is one shared-memory segment of
this process (``/dev/shm``), so that others on the host read or write it in place: a trainer
writes each tensor once, straight into the stage's staging (``ipc`` with shared staging,
``locations``), and the other ranks of a tensor-parallel stage copy their slices of each
tensor out of it (``locate``, ``map_segment``). Otherwise (a GPU stage) a set is pinned
private memory. The segment's space is reserved when the set is made (a full ``/dev/shm``
is an error then, not a SIGBUS later) and its pages are faulted in once.

A segment is removed when its set is dropped, and at exit; the resource tracker removes it
if this process dies.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import weakref
from multiprocessing import resource_tracker
from typing import Any

import torch

from omnistage.errors import InvalidRequestError

logger = logging.getLogger(__name__)

ALIGN = 64  # every tensor starts on a cache line
SPARE_SETS = 4  # staging sets a stage keeps for its next updates
SHM = "/dev/shm"
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

_SETS: weakref.WeakSet[StagingSet] = weakref.WeakSet()


def layout_of(specs: dict[str, tuple[torch.dtype, list[int]]]) -> Layout:
    return tuple((name, dtype, tuple(shape)) for name, (dtype, shape) in specs.items())


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize


def _remove(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(SHM, name))


def _unlink(name: str) -> None:
    _remove(name)
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")


class StagingSet:
    """The buffers of one layout (see the module docstring)."""

    def __init__(self, layout: Layout, *, shared: bool, pinned: bool = False) -> None:
        self.layout = layout
        offsets, total = [], 0
        for _, dtype, shape in layout:
            offsets.append(total)
            total += -(-_nbytes(dtype, shape) // ALIGN) * ALIGN
        self.nbytes = max(total, 1)
        self.name: str | None = None
        if shared:
            flat = self._shared(self.nbytes)
        else:
            flat = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.base = flat.data_ptr()
        self.tensors: dict[str, torch.Tensor] = {}
        for (name, dtype, shape), offset in zip(layout, offsets, strict=True):
            count = _nbytes(dtype, shape)
            self.tensors[name] = flat[offset : offset + count].view(dtype).view(shape)
        self.offsets = dict(zip((name for name, _, _ in layout), offsets, strict=True))
        _SETS.add(self)

    def _shared(self, nbytes: int) -> torch.Tensor:
        name = f"omnistage-w{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # space now, or an error now
            mm = mmap.mmap(fd, nbytes)
        except OSError as exc:
            _remove(name)  # never registered
            raise InvalidRequestError(
                "update_info", f"cannot stage {nbytes} bytes in shared memory: {exc}"
            ) from None
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")  # removed if this process dies
        self.name = name
        weakref.finalize(self, _unlink, name)  # and when the set goes, or at exit
        with contextlib.suppress(OSError):
            mm.madvise(_POPULATE_WRITE)  # fault the pages in once, in the kernel
        return torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping while views live

    def locations(self, names: list[str]) -> list[dict[str, Any]]:
        """Where each of ``names`` is, for another process of the host."""
        if self.name is None:
            raise InvalidRequestError("update_info", "this stage's staging is not shared")
        return [{"shm": self.name, "offset": self.offsets[name]} for name in names]


class StagingPool:
    """A stage's spare staging sets, reused by layout; beyond ``SPARE_SETS`` they are freed."""

    def __init__(self, shared: bool, *, pinned: bool, required: bool = False) -> None:
        self.shared, self.pinned, self.required = shared, pinned, required
        self._spare: list[StagingSet] = []

    def spare(self, layout: Layout) -> StagingSet | None:
        for i, staging in enumerate(self._spare):
            if staging.layout == layout:
                return self._spare.pop(i)
        return None

    def new(self, layout: Layout) -> StagingSet:
        """A new set; where shared memory is short (a small ``/dev/shm``) a private one,
        unless others must read it (``required``: a tensor-parallel stage's ranks)."""
        try:
            return StagingSet(layout, shared=self.shared, pinned=self.pinned)
        except InvalidRequestError:
            if self.required:
                raise
            logger.warning("weight staging in private memory: shared memory is short")
            return StagingSet(layout, shared=False, pinned=self.pinned)

    def take(self, layout: Layout) -> StagingSet:
        """A spare set of ``layout``, else a new one."""
        staging = self.spare(layout)
        return staging if staging is not None else self.new(layout)

    def keep(self, sets: list[StagingSet]) -> None:
        """``sets`` are free to stage the next updates in (the newest kept first)."""
        self._spare = [*sets, *self._spare][:SPARE_SETS]


def locate(tensor: torch.Tensor) -> tuple[str, int] | None:
    """``(segment, byte offset)`` of a tensor inside a shared set of this process."""
    ptr = tensor.data_ptr()
    for staged in list(_SETS):
        if staged.name is not None and staged.base <= ptr < staged.base + staged.nbytes:
            return staged.name, ptr - staged.base
    return None


def map_segment(name: str) -> torch.Tensor:
    """Another process's segment, mapped here as bytes (the mapping lives while views do)."""
    if not name.startswith("omnistage-w") or "/" in name:
        raise InvalidRequestError("update_info", f"{name!r:.80} is no staging segment")
    fd = os.open(os.path.join(SHM, name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)
