"""How much of a tensor's memory is backed by pages right now (``mincore``): exact, unlike the
process RSS, which other allocations move."""

from __future__ import annotations

import ctypes
import mmap

import torch


def resident_bytes(tensor: torch.Tensor) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page
