"""Tensors as a trainer on the same host shares them with a stage (the ``ipc`` backend's
shared-memory segments), and the ``update_info`` that describes them: for the weight-sync
tests, unit and end to end."""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import torch

from omnistage.rl.protocol import dtype_name


def describe(named: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
    return {
        "names": [n for n, _ in named],
        "dtype_names": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        **extra,
    }


class Shared:
    """Tensors in shared-memory segments, as a trainer on the same host shares them."""

    def __init__(self) -> None:
        self.segments: list[shared_memory.SharedMemory] = []

    def chunk(self, named: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
        """``update_info`` for ``named`` (contiguous copies in one new segment)."""
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
        segment = shared_memory.SharedMemory(create=True, size=max(1, sum(f.numel() for f in flat)))
        self.segments.append(segment)
        assert segment.buf is not None
        handles, offset = [], 0
        for data in flat:
            if data.numel():
                view = torch.frombuffer(
                    segment.buf, dtype=torch.uint8, count=data.numel(), offset=offset
                )
                view.copy_(data)
                del view
            handles.append({"shm": segment.name, "offset": offset})
            offset += data.numel()
        return describe(named, ipc_handles=handles, **extra)

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
            segment.unlink()
