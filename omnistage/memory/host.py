"""The host backend: arena memory as anonymous private mappings of this process.

A region is released with ``madvise(MADV_DONTNEED)`` and mapped again by faulting fresh pages
in (``MADV_POPULATE_WRITE``, or on first touch for an on-touch region). An offload (level 1)
keeps a region's contents in a host *backup*; the backup would be host memory too, so this
backend moves the pages instead of copying them (``mremap`` with ``MREMAP_DONTUNMAP``): the
region's address stays mapped, empty, and the pages come back to it on wake — page-table
updates, no bytes copied, no fresh pages to zero.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from dataclasses import dataclass

import torch

from omnistage.memory.backend import (
    PAGE_SIZE,
    ArenaError,
    ArenaOutOfMemoryError,
    Backend,
    Region,
    round_up,
)

# Linux MADV_POPULATE_WRITE (5.14+); Python's mmap module does not export it before 3.12.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
HUGE_PAGE_SIZE = 2 * 1024 * 1024


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@dataclass
class _HostMapping:
    mm: mmap.mmap
    offset: int
    nbytes: int
    address: int  # of the first byte at ``offset``

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.offset, count=self.nbytes)  # type: ignore[call-overload]

    def release_pages(self) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, self.offset, self.nbytes)

    def resident_bytes(self) -> int:
        """Bytes of the mapping backed by pages now (``mincore``)."""
        pages = -(-self.nbytes // PAGE_SIZE)
        vec = (ctypes.c_ubyte * pages)()
        if _libc().mincore(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes), vec):
            return self.nbytes  # cannot tell: count it all, never less than the truth
        return bytes(vec).count(1) * PAGE_SIZE

    def populate(self) -> None:
        """Fault every page in now, in the kernel: several times faster than faulting page by
        page during the copy that follows (374 MiB: ~60 ms instead of ~400 ms on this
        machine). Kernels before 5.14 lack it; the copy then faults the pages in."""
        with contextlib.suppress(OSError):
            self.mm.madvise(_MADV_POPULATE_WRITE, self.offset, self.nbytes)


_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MOVE_FLAGS = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP


class PageMover:
    """Moves the pages of an address range to another range of this process, in the kernel.

    ``mremap(MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP)`` (Linux 5.7+): the pages'
    page-table entries move to the destination — whatever was mapped there is unmapped — and
    the source keeps its mapping, empty (reads give zeros, writes fault in fresh pages). A
    2 MiB-aligned range of transparent huge pages moves as whole page-table entries.
    """

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._mremap = libc.mremap
        self._mremap.restype = ctypes.c_void_p
        self._mremap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip

    def move(self, src: int, dst: int, nbytes: int) -> None:
        if self._mremap(src, nbytes, nbytes, _MOVE_FLAGS, dst) != dst:
            err = ctypes.get_errno()
            raise ArenaError(f"moving {nbytes} bytes of pages failed: {os.strerror(err)}")

    def works(self) -> bool:
        """Whether this kernel moves pages as ``move`` needs (probed on two small mappings)."""
        size = 2 * PAGE_SIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        with mmap.mmap(-1, size, flags=flags) as a, mmap.mmap(-1, size, flags=flags) as b:
            a[0], b[0] = 7, 0
            src, dst = _address(a), _address(b)
            try:
                self.move(src, dst, size)
            except ArenaError:
                return False
            return b[0] == 7 and a[0] == 0


def _address(mm: mmap.mmap) -> int:
    """The address of a mapping's first byte (the probe's buffer export ends at once)."""
    probe = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


_PAGE_MOVER: PageMover | None | bool = False  # False: not probed yet


def page_mover() -> PageMover | None:
    """The process's ``PageMover``, or None where the kernel cannot move pages (not Linux,
    Linux before 5.7) and offloads copy instead."""
    global _PAGE_MOVER
    if _PAGE_MOVER is False:
        mover = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                candidate = PageMover()
                mover = candidate if candidate.works() else None
        _PAGE_MOVER = mover
    return _PAGE_MOVER  # type: ignore[return-value]


class HostBackend(Backend):
    """Anonymous private mappings on the host, released with ``MADV_DONTNEED``.

    ``MAP_PRIVATE`` matters: on a shared mapping ``MADV_DONTNEED`` frees nothing and the
    old contents survive. ``capacity_bytes`` caps the bytes mapped at once so tests (and
    operators who want a hard budget) can see an out-of-memory wake and its rollback.
    ``move_pages`` (default: where the kernel can) offloads by moving pages to the backup and
    back instead of copying them; either way the process keeps the bytes (a host offload never
    leaves host memory) and the region's own memory is what is released.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        use_huge_pages: bool = True,
        move_pages: bool | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self.capacity_bytes = capacity_bytes
        self.use_huge_pages = use_huge_pages
        mover = page_mover() if move_pages is not False else None
        if move_pages and mover is None:
            raise ArenaError("this kernel cannot move pages (mremap MREMAP_DONTUNMAP, Linux 5.7+)")
        self._mover = mover
        self._mapped_bytes = 0
        self._lock = threading.Lock()
        self._backup_owner: dict[int, _HostMapping] = {}

    @property
    def moves_pages(self) -> bool:
        return self._mover is not None

    @property
    def granularity(self) -> int:
        return HUGE_PAGE_SIZE if self.use_huge_pages else PAGE_SIZE

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    def _charge(self, nbytes: int) -> None:
        with self._lock:
            if (
                self.capacity_bytes is not None
                and self._mapped_bytes + nbytes > self.capacity_bytes
            ):
                raise ArenaOutOfMemoryError(
                    f"host arena capacity exceeded: {self._mapped_bytes + nbytes} bytes requested, "
                    f"capacity {self.capacity_bytes} bytes"
                )
            self._mapped_bytes += nbytes

    def _uncharge(self, nbytes: int) -> None:
        with self._lock:
            self._mapped_bytes -= nbytes

    def _new_mapping(self, nbytes: int, huge_pages: bool | None = None) -> _HostMapping:
        if not (self.use_huge_pages if huge_pages is None else huge_pages):
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where THP is "always"
                mm.madvise(mmap.MADV_NOHUGEPAGE)
            return _HostMapping(mm, 0, nbytes, _address(mm))
        # Transparent huge pages only back 2 MiB-aligned ranges: over-map and align.
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = _address(mm)
        offset = round_up(base, HUGE_PAGE_SIZE) - base
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        return _HostMapping(mm, offset, nbytes, base + offset)

    def allocate(self, nbytes: int, *, on_touch: bool = False) -> Region:
        size = round_up(max(nbytes, 1), self.granularity)
        self._charge(size)
        try:
            mapping = self._new_mapping(size, self.use_huge_pages and not on_touch)
        except BaseException:
            self._uncharge(size)
            raise
        mapping.populate()
        return Region(nbytes=size, device=self.device, handle=mapping, on_touch=on_touch)

    @staticmethod
    def _mapping(region: Region) -> _HostMapping:
        if not isinstance(region.handle, _HostMapping):
            raise ArenaError("region does not belong to the host backend")
        return region.handle

    def as_tensor(self, region: Region) -> torch.Tensor:
        return self._mapping(region).tensor()

    def unmap(self, region: Region) -> None:
        if not region.is_mapped:
            return
        self._mapping(region).release_pages()
        region.is_mapped = False
        self._uncharge(region.nbytes)

    def resident_bytes(self, region: Region) -> int:
        if not region.is_mapped:
            return 0
        if not region.on_touch:
            return region.nbytes
        return self._mapping(region).resident_bytes()

    def map(self, region: Region, populate: bool = True) -> None:
        if region.is_mapped:
            return
        self._charge(region.nbytes)
        if populate and not region.on_touch:
            self._mapping(region).populate()
        region.is_mapped = True

    # -- offload by moving pages (the copying defaults where the kernel cannot) -----------

    def _backup_mapping(self, region: Region) -> _HostMapping:
        if region.host_backup is None:
            region.host_backup = self.new_host_backup(region.nbytes)
        return self._backup_owner[region.host_backup.data_ptr()]

    def save(self, region: Region) -> None:
        if self._mover is None:
            return super().save(region)
        # A fresh backup is address space only: nothing to fault in, nothing to compact.
        backup = self._backup_mapping(region)
        self._mover.move(self._mapping(region).address, backup.address, region.nbytes)

    def unsave(self, region: Region) -> None:
        if self._mover is not None:
            backup = self._backup_mapping(region)
            self._mover.move(backup.address, self._mapping(region).address, region.nbytes)

    def restore(self, region: Region) -> None:
        if self._mover is None:
            return super().restore(region)
        if region.is_mapped:
            return
        backup = self._backup_mapping(region)
        self._charge(region.nbytes)
        try:
            self._mover.move(backup.address, self._mapping(region).address, region.nbytes)
        except BaseException:
            self._uncharge(region.nbytes)
            raise
        region.is_mapped = True

    def unrestore(self, region: Region) -> None:
        if self._mover is None:
            return super().unrestore(region)
        if not region.is_mapped:
            return
        backup = self._backup_mapping(region)
        self._mover.move(self._mapping(region).address, backup.address, region.nbytes)
        region.is_mapped = False
        self._uncharge(region.nbytes)

    def free(self, region: Region) -> None:
        self.drop_host_backup(region)
        if region.is_mapped:
            self._uncharge(region.nbytes)
            region.is_mapped = False
        mapping = self._mapping(region)
        try:
            mapping.mm.close()
        except BufferError:
            # Tensors still view the mapping; it is unmapped when the last one dies.
            mapping.release_pages()

    def new_host_backup(self, nbytes: int) -> torch.Tensor:
        mapping = self._new_mapping(round_up(max(nbytes, 1), self.granularity))
        backup = mapping.tensor()[:nbytes]
        self._backup_owner[backup.data_ptr()] = mapping
        return backup

    def release_host_backup(self, backup: torch.Tensor) -> int:
        # The backup is only needed while the region sleeps; between cycles we keep the
        # mapping (no mmap/munmap per cycle) but hand its pages back to the kernel.
        mapping = self._backup_owner.get(backup.data_ptr())
        if mapping is None:
            return 0
        mapping.release_pages()
        return mapping.nbytes

    def drop_host_backup(self, region: Region) -> None:
        if region.host_backup is not None:
            mapping = self._backup_owner.pop(region.host_backup.data_ptr(), None)
            if mapping is not None:
                mapping.release_pages()
            region.host_backup = None  # the last reference: the mapping goes with it

    def prepare_host_backup(self, backup: torch.Tensor) -> None:
        mapping = self._backup_owner.get(backup.data_ptr())
        if mapping is not None and self._mover is None:  # moved pages need no fresh ones
            mapping.populate()
