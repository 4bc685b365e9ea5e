"""CUDA virtual-memory backend on ``cuda-bindings`` (the driver API).

Each region is one reserved virtual address range with physical memory mapped behind it in
chunks (multiples of the allocation granularity). Sleep unmaps and releases the physical
chunks; wake creates and maps new ones at the same addresses, so tensors and captured CUDA
graphs stay valid. Host backups are pinned and retained between cycles (pinning per cycle is
what makes naive offloading slow).

``cuda-bindings`` is imported lazily and only here; tests pass a fake driver module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from omnistage.memory.backend import ArenaError, ArenaOutOfMemoryError, Backend, Region, round_up

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


def load_driver() -> ModuleType:
    """Import the CUDA driver bindings (``cuda-bindings`` ≥ 12.6, or the older ``cuda`` name)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as exc:
            raise ArenaError(
                "the CUDA arena backend needs cuda-bindings: pip install 'omnistage[gpu]'"
            ) from exc
    return driver


class _CudaArrayView:
    """Exposes raw device memory through ``__cuda_array_interface__`` for zero-copy wrap."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


@dataclass
class _VmmHandle:
    base: int
    chunks: list[tuple[int, int]]  # (offset, size)
    physical: list[Any] = field(default_factory=list)  # per chunk: its handle, None if unmapped


class CudaVmmBackend(Backend):
    def __init__(
        self,
        device: str | torch.device = "cuda",
        driver: ModuleType | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.device = torch.device(device)
        self.ordinal = self.device.index if self.device.index is not None else 0
        self.device = torch.device("cuda", self.ordinal)
        self._driver = driver if driver is not None else load_driver()
        d = self._driver
        self._check(d.cuInit(0), "cuInit")
        cu_device = self._check(d.cuDeviceGet(self.ordinal), "cuDeviceGet")
        self._context = self._check(
            d.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._prop = d.CUmemAllocationProp()
        self._prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.ordinal
        self._access = d.CUmemAccessDesc()
        self._access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self.ordinal
        self._access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._granularity = int(
            self._check(
                d.cuMemGetAllocationGranularity(
                    self._prop,
                    d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        self.chunk_bytes = round_up(chunk_bytes, self._granularity)

    @property
    def granularity(self) -> int:
        return self._granularity

    def _check(self, result: Any, what: str) -> Any:
        """Unpack a driver call's ``(CUresult, *values)`` tuple, raising on error."""
        if not isinstance(result, tuple):
            result = (result,)
        err, *values = result
        if int(err) != 0:
            name = getattr(err, "name", str(int(err)))
            if "OUT_OF_MEMORY" in name:
                raise ArenaOutOfMemoryError(f"{what} failed: {name}")
            raise ArenaError(f"{what} failed: {name}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _make_current(self) -> None:
        # The driver API acts on the calling thread's current context; the stage's worker
        # thread may not have one yet.
        self._check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocate(self, nbytes: int, *, on_touch: bool = False) -> Region:
        """``on_touch`` changes nothing here: mapping device memory back costs no page
        faults later."""
        self._make_current()
        size = round_up(max(nbytes, 1), self._granularity)
        base = int(
            self._check(
                self._driver.cuMemAddressReserve(size, self._granularity, 0, 0),
                "cuMemAddressReserve",
            )
        )
        chunks = [
            (off, min(self.chunk_bytes, size - off)) for off in range(0, size, self.chunk_bytes)
        ]
        region = Region(
            nbytes=size,
            device=self.device,
            handle=_VmmHandle(base, chunks, [None] * len(chunks)),
            is_mapped=False,
        )
        try:
            self.map(region)
        except BaseException:
            self._driver.cuMemAddressFree(base, size)
            raise
        return region

    def map(self, region: Region, populate: bool = True) -> None:
        """Map every chunk that is not mapped; on failure unmap what this call mapped."""
        if region.is_mapped:
            return
        self._make_current()
        d, handle = self._driver, self._vmm(region)
        done: list[int] = []
        try:
            for i, (offset, size) in enumerate(handle.chunks):
                if handle.physical[i] is not None:
                    continue  # left mapped by an unmap that failed half-way
                phys = self._check(d.cuMemCreate(size, self._prop, 0), "cuMemCreate")
                try:
                    self._check(d.cuMemMap(handle.base + offset, size, 0, phys, 0), "cuMemMap")
                except BaseException:
                    d.cuMemRelease(phys)
                    raise
                handle.physical[i] = phys
                done.append(i)
                self._check(
                    d.cuMemSetAccess(handle.base + offset, size, [self._access], 1),
                    "cuMemSetAccess",
                )
        except BaseException:
            for i in reversed(done):
                offset, size = handle.chunks[i]
                d.cuMemUnmap(handle.base + offset, size)
                d.cuMemRelease(handle.physical[i])
                handle.physical[i] = None
            raise
        region.is_mapped = True

    def unmap(self, region: Region) -> None:
        """Unmap and release every mapped chunk; a failing chunk is reported after the others
        were tried, and stays recorded as mapped (a later map or unmap handles it)."""
        d, handle = self._driver, self._vmm(region)
        if not any(p is not None for p in handle.physical):
            region.is_mapped = False
            return
        self._make_current()
        first_error: BaseException | None = None
        for i, (offset, size) in enumerate(handle.chunks):
            phys = handle.physical[i]
            if phys is None:
                continue
            try:
                self._check(d.cuMemUnmap(handle.base + offset, size), "cuMemUnmap")
                self._check(d.cuMemRelease(phys), "cuMemRelease")
            except ArenaError as exc:
                first_error = first_error or exc
                continue
            handle.physical[i] = None
        region.is_mapped = False
        if first_error is not None:
            raise first_error

    def free(self, region: Region) -> None:
        self.unmap(region)
        handle = self._vmm(region)
        self._check(self._driver.cuMemAddressFree(handle.base, region.nbytes), "cuMemAddressFree")

    def as_tensor(self, region: Region) -> torch.Tensor:
        view = _CudaArrayView(self._vmm(region).base, region.nbytes)
        return torch.as_tensor(view, device=self.device)

    def new_host_backup(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def drop_host_backup(self, region: Region) -> None:
        # Pinned buffers are retained between cycles (re-pinning is the slow part); sleeping
        # deeper is the one time to give them back. Dropping the last reference returns the
        # block to torch's pinned-memory cache, so empty that cache too.
        region.host_backup = None
        empty_host_cache = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(
            torch._C, "_host_emptyCache", None
        )
        if empty_host_cache is not None and torch.cuda.is_available():
            empty_host_cache()

    @staticmethod
    def _vmm(region: Region) -> _VmmHandle:
        if not isinstance(region.handle, _VmmHandle):
            raise ArenaError("region does not belong to the CUDA VMM backend")
        return region.handle
