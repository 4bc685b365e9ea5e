"""A stand-in for ``cuda.bindings.driver``: this machine has no CUDA driver.

It keeps the driver's calling convention (every call returns ``(CUresult, *values)``), records
each call, tracks reserved ranges and mapped physical handles, and fails the N-th call of a
chosen function on request. Memory contents are simulated on the host by ``FakeVmmBackend``.
"""

from __future__ import annotations

import enum
import itertools
from types import SimpleNamespace

import torch

from omnistage.memory.backend import Region
from omnistage.memory.cuda_vmm import CudaVmmBackend


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2


class _Struct(SimpleNamespace):
    pass


class FakeDriver:
    GRANULARITY = 2 * 1024 * 1024

    def __init__(self, capacity_bytes: int = 1 << 40) -> None:
        self.calls: list[str] = []
        self.capacity_bytes = capacity_bytes
        self.fail_on: dict[str, int] = {}  # function name -> fail when its count reaches this
        self._counts: dict[str, int] = {}
        self._next_addr = itertools.count(0x7F0000000000, 1 << 32)
        self._next_handle = itertools.count(1)
        self.reserved: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # handle -> size
        self.mappings: dict[int, int] = {}  # address -> handle
        self.current_context = None
        self.CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def CUmemAllocationProp(self):  # noqa: N802 - driver naming
        return _Struct(type=None, location=_Struct(type=None, id=None))

    def CUmemAccessDesc(self):  # noqa: N802
        return _Struct(location=_Struct(type=None, id=None), flags=None)

    def _enter(self, name: str) -> CUresult:
        self.calls.append(name)
        self._counts[name] = self._counts.get(name, 0) + 1
        if self.fail_on.get(name) == self._counts[name]:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY
        return CUresult.CUDA_SUCCESS

    @property
    def physical_bytes(self) -> int:
        return sum(self.handles.values())

    def cuInit(self, flags):  # noqa: N802
        return (self._enter("cuInit"),)

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return (self._enter("cuDeviceGet"), ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
        return (self._enter("cuDevicePrimaryCtxRetain"), f"ctx{dev}")

    def cuCtxSetCurrent(self, ctx):  # noqa: N802
        self.current_context = ctx
        return (self._enter("cuCtxSetCurrent"),)

    def cuMemGetAllocationGranularity(self, prop, flags):  # noqa: N802
        return (self._enter("cuMemGetAllocationGranularity"), self.GRANULARITY)

    def cuMemAddressReserve(self, size, alignment, addr, flags):  # noqa: N802
        err = self._enter("cuMemAddressReserve")
        if err:
            return (err, 0)
        base = next(self._next_addr)
        self.reserved[base] = size
        return (err, base)

    def cuMemAddressFree(self, ptr, size):  # noqa: N802
        self.reserved.pop(ptr)
        return (self._enter("cuMemAddressFree"),)

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        err = self._enter("cuMemCreate")
        if err == 0 and self.physical_bytes + size > self.capacity_bytes:
            err = CUresult.CUDA_ERROR_OUT_OF_MEMORY
        if err:
            return (err, None)
        handle = next(self._next_handle)
        self.handles[handle] = size
        return (err, handle)

    def cuMemRelease(self, handle):  # noqa: N802
        err = self._enter("cuMemRelease")
        if err == 0:
            self.handles.pop(handle)
        return (err,)

    def cuMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802
        err = self._enter("cuMemMap")
        if err == 0:
            if self.current_context is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.mappings[ptr] = handle
        return (err,)

    def cuMemUnmap(self, ptr, size):  # noqa: N802
        err = self._enter("cuMemUnmap")
        if err == 0:
            self.mappings.pop(ptr)
        return (err,)

    def cuMemSetAccess(self, ptr, size, descs, count):  # noqa: N802
        return (self._enter("cuMemSetAccess"),)


class FakeVmmBackend(CudaVmmBackend):
    """The real VMM backend logic over the fake driver, with memory simulated on the host.

    Unmapping forgets a region's contents and mapping fills it with garbage, as a real
    unmap/map cycle does, so a missed copy shows up as wrong data.
    """

    def __init__(self, driver: FakeDriver, chunk_bytes: int = 4 * 1024 * 1024) -> None:
        super().__init__("cuda:0", driver=driver, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
        self.memory: dict[int, torch.Tensor] = {}
        self.num_synchronize = 0

    def synchronize(self) -> None:
        self.num_synchronize += 1

    def as_tensor(self, region: Region) -> torch.Tensor:
        base = self._vmm(region).base
        if base not in self.memory:
            self.memory[base] = torch.full((region.nbytes,), 0xAB, dtype=torch.uint8)
        return self.memory[base]

    def map(self, region: Region, populate: bool = True) -> None:
        was_mapped = region.is_mapped
        super().map(region)
        if not was_mapped and self._vmm(region).base in self.memory:
            self.memory[self._vmm(region).base].fill_(0xAB)

    def new_host_backup(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)
