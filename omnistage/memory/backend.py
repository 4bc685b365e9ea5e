"""Physical-memory backends for the arena.

A backend hands out *regions*: a fixed virtual address range whose physical memory can be
released and mapped again without the address changing. The arena above it knows nothing
of how that is done; the host backend uses an anonymous private mapping and
``madvise(MADV_DONTNEED)``, the CUDA backend (``cuda_vmm.py``) the driver's virtual-memory API.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

PAGE_SIZE = mmap.PAGESIZE
# Linux MADV_POPULATE_WRITE (5.14+); Python's mmap module does not export it before 3.12.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
HUGE_PAGE_SIZE = 2 * 1024 * 1024


class ArenaError(RuntimeError):
    """Base class of memory-layer errors."""


class ArenaOutOfMemoryError(ArenaError):
    """The backend could not map physical memory for a region."""


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class Region:
    """A virtual address range owned by a backend. ``handle`` is backend-private."""

    nbytes: int
    device: torch.device
    handle: object
    is_mapped: bool = True
    host_backup: torch.Tensor | None = field(default=None, repr=False)


class Backend(ABC):
    """What the arena needs from a memory backend."""

    device: torch.device

    @abstractmethod
    def allocate(self, nbytes: int) -> Region:
        """Reserve an address range and map physical memory behind it."""

    @abstractmethod
    def as_tensor(self, region: Region) -> torch.Tensor:
        """A flat uint8 tensor viewing the whole region, zero-copy."""

    @abstractmethod
    def unmap(self, region: Region) -> None:
        """Release the region's physical memory; the address stays reserved."""

    @abstractmethod
    def map(self, region: Region) -> None:
        """Map fresh physical memory at the region's address (contents undefined)."""

    @abstractmethod
    def free(self, region: Region) -> None:
        """Release the region entirely (address and memory)."""

    @abstractmethod
    def new_host_backup(self, nbytes: int) -> torch.Tensor:
        """A host buffer for offloading a region (pinned where it matters)."""

    def release_host_backup(self, backup: torch.Tensor) -> int:
        """Give the backup's pages back but keep the buffer; returns bytes released."""
        return 0

    def drop_host_backup(self, region: Region) -> None:
        """Free a region's backup for good (sleeping deeper); a later offload allocates anew."""
        if region.host_backup is not None:
            self.release_host_backup(region.host_backup)
            region.host_backup = None

    def prepare_host_backup(self, backup: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Make the backup ready to be written (e.g. fault its pages in) before an offload."""

    def synchronize(self) -> None:  # noqa: B027 - a no-op where the device is the host
        """Wait for all device work touching arena memory to finish."""

    @property
    def granularity(self) -> int:
        return PAGE_SIZE


@dataclass
class _HostMapping:
    mm: mmap.mmap
    offset: int
    nbytes: int

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.offset, count=self.nbytes)  # type: ignore[call-overload]

    def release_pages(self) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, self.offset, self.nbytes)

    def populate(self) -> None:
        """Fault every page in now, in the kernel: several times faster than faulting page by
        page during the copy that follows (374 MiB: ~60 ms instead of ~400 ms on this
        machine). Kernels before 5.14 lack it; the copy then faults the pages in."""
        with contextlib.suppress(OSError):
            self.mm.madvise(_MADV_POPULATE_WRITE, self.offset, self.nbytes)


class HostBackend(Backend):
    """Anonymous private mappings on the host, released with ``MADV_DONTNEED``.

    ``MAP_PRIVATE`` matters: on a shared mapping ``MADV_DONTNEED`` frees nothing and the
    old contents survive. ``capacity_bytes`` caps the bytes mapped at once so tests (and
    operators who want a hard budget) can see an out-of-memory wake and its rollback.
    """

    def __init__(self, capacity_bytes: int | None = None, use_huge_pages: bool = True) -> None:
        self.device = torch.device("cpu")
        self.capacity_bytes = capacity_bytes
        self.use_huge_pages = use_huge_pages
        self._mapped_bytes = 0
        self._lock = threading.Lock()
        self._backup_owner: dict[int, _HostMapping] = {}

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

    def _new_mapping(self, nbytes: int) -> _HostMapping:
        if not self.use_huge_pages:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return _HostMapping(mm, 0, nbytes)
        # Transparent huge pages only back 2 MiB-aligned ranges: over-map and align.
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()  # type: ignore[call-overload]
        offset = round_up(base, HUGE_PAGE_SIZE) - base
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        return _HostMapping(mm, offset, nbytes)

    def allocate(self, nbytes: int) -> Region:
        size = round_up(max(nbytes, 1), self.granularity)
        self._charge(size)
        try:
            mapping = self._new_mapping(size)
        except BaseException:
            self._uncharge(size)
            raise
        mapping.populate()
        return Region(nbytes=size, device=self.device, handle=mapping)

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

    def map(self, region: Region) -> None:
        if region.is_mapped:
            return
        self._charge(region.nbytes)
        self._mapping(region).populate()
        region.is_mapped = True

    def free(self, region: Region) -> None:
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
        if mapping is not None:
            mapping.populate()
