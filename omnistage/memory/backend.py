"""Physical-memory backends for the arena: what one must offer (``Backend``) and the region
it hands out.

A backend hands out *regions*: a fixed virtual address range whose physical memory can be
released and mapped again without the address changing. The arena above it knows nothing
of how that is done; the host backend (``host.py``) uses an anonymous private mapping and
``madvise(MADV_DONTNEED)``, the CUDA backend (``cuda_vmm.py``) the driver's virtual-memory API.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

PAGE_SIZE = mmap.PAGESIZE


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
    # Mapped back without its pages: they come in as they are first touched (a cache).
    on_touch: bool = False


class Backend(ABC):
    """What the arena needs from a memory backend.

    An offload is ``save`` then ``unmap`` (``unsave`` undoes a ``save`` whose offload is rolled
    back); a wake from it is ``restore`` (``unrestore`` undoes one whose wake is rolled back).
    The defaults copy to and from ``new_host_backup`` buffers.
    """

    device: torch.device

    @abstractmethod
    def allocate(self, nbytes: int, *, on_touch: bool = False) -> Region:
        """Reserve an address range and map physical memory behind it. ``on_touch``: after a
        release, the region comes back without its pages, which arrive as they are first
        touched (where a backend can: the host's, in small pages, so a first touch costs a
        4 KiB page, not a 2 MiB one)."""

    @abstractmethod
    def as_tensor(self, region: Region) -> torch.Tensor:
        """A flat uint8 tensor viewing the whole region, zero-copy."""

    @abstractmethod
    def unmap(self, region: Region) -> None:
        """Release the region's physical memory; the address stays reserved."""

    @abstractmethod
    def map(self, region: Region, populate: bool = True) -> None:
        """Map fresh physical memory at the region's address (contents undefined).

        ``populate=False`` lets a backend leave the memory to be faulted in by the first
        writes (the host's, when a reload is about to write every page)."""

    @abstractmethod
    def free(self, region: Region) -> None:
        """Release the region entirely (address and memory)."""

    def resident_bytes(self, region: Region) -> int:
        """Bytes of the region backed by memory now: all of a mapped one, unless its pages
        come in on touch and the backend can tell how many did."""
        return region.nbytes if region.is_mapped else 0

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

    def save(self, region: Region) -> None:
        """Put the region's contents into its host backup (the first half of an offload)."""
        if region.host_backup is None:
            region.host_backup = self.new_host_backup(region.nbytes)
        self.prepare_host_backup(region.host_backup)
        region.host_backup.copy_(self.as_tensor(region))

    def unsave(self, region: Region) -> None:  # noqa: B027 - a copy left the region as it was
        """Undo ``save`` for an offload rolled back before the region was unmapped."""

    def restore(self, region: Region) -> None:
        """Map memory at the region's address holding its backup's contents."""
        if region.host_backup is None:
            raise ArenaError("restoring a region that has no host backup")
        self.map(region)
        try:
            self.as_tensor(region).copy_(region.host_backup)
        except BaseException:
            self.unmap(region)
            raise

    def unrestore(self, region: Region) -> None:
        """Undo ``restore`` for a wake rolled back (a copied backup still holds the contents)."""
        self.unmap(region)

    def synchronize(self) -> None:  # noqa: B027 - a no-op where the device is the host
        """Wait for all device work touching arena memory to finish."""

    @property
    def granularity(self) -> int:
        return PAGE_SIZE
