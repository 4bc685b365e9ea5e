"""How a stage reads tensors a trainer on the same host shared (the ``ipc`` backend):
shared-memory segments on CPU (``{"shm", "offset"}``), CUDA IPC handles on GPU
(``{"cuda": {...}}``). Everything is copied into the stage's own host buffer, its values
checked in the same pass, before the call answers, so the trainer may reuse its segment as
soon as it has the reply. (A trainer that writes into the stage's own shared staging instead
saves this copy: see ``omnistage.stage.weights.sync``.)
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.weights.checks import copy_checked


def _copy_out(buffer: memoryview, offset: int, host: torch.Tensor) -> bool:
    """``host`` filled from ``buffer`` at ``offset``, its values checked in the same pass
    (False: NaN or Inf); no view outlives the call (the segment can then be closed)."""
    nbytes = host.numel() * host.element_size()
    if not nbytes:
        return True
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    try:
        return copy_checked(host, flat.view(host.dtype).view(host.shape))
    finally:
        del flat


class SharedSegments:
    """The trainer's shared-memory segments of one chunk, each opened (mapped) once."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        from multiprocessing import resource_tracker, shared_memory

        if name not in self._open:
            try:
                segment = shared_memory.SharedMemory(name=name, create=False)
            except (OSError, ValueError) as exc:
                raise InvalidRequestError(
                    "update_info.ipc_handles", f"no such segment: {exc}"
                ) from None
            # The trainer owns the segment: this process must never unlink it.
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
            self._open[name] = segment
        return self._open[name]

    def close(self) -> None:
        for segment in self._open.values():
            segment.close()
        self._open.clear()


def from_ipc_handle(handle: dict[str, Any], host: torch.Tensor, segments: SharedSegments) -> bool:
    """``host`` filled from a tensor the trainer shared and checked (False: NaN or Inf; the
    handle's shape was checked by ``UpdateInfo.from_json``; a CUDA handle reaches here only
    on a GPU stage)."""
    dtype, shape = host.dtype, list(host.shape)
    nbytes = host.numel() * host.element_size()
    if "shm" in handle:
        segment = segments.get(str(handle["shm"]))
        offset = int(handle.get("offset", 0))
        if offset < 0 or offset + nbytes > segment.size:
            raise InvalidRequestError("update_info.ipc_handles", "points past its segment")
        if segment.buf is None:
            raise InvalidRequestError("update_info.ipc_handles", "the segment is closed")
        return _copy_out(segment.buf, offset, host)
    try:  # never run on a GPU yet
        spec = handle["cuda"]
        args = (
            int(spec["device"]),
            base64.b64decode(spec["handle"]),
            int(spec["storage_size"]),
            int(spec["storage_offset"]),
            base64.b64decode(spec["ref_counter_handle"]),
            int(spec["ref_counter_offset"]),
            base64.b64decode(spec["event_handle"]) if spec.get("event_handle") else b"",
            bool(spec.get("event_sync_required", False)),
        )
        tensor_offset = int(spec.get("tensor_offset", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            "update_info.ipc_handles", f"a malformed CUDA IPC handle: {type(exc).__name__}: {exc}"
        ) from None
    storage = torch.UntypedStorage._new_shared_cuda(*args)  # type: ignore[attr-defined]
    tensor = torch.empty(0, dtype=dtype, device=f"cuda:{args[0]}")
    strides = torch.empty(shape).stride()  # contiguous, as the trainer sends them
    tensor.set_(storage, tensor_offset, shape, strides)
    return copy_checked(host, tensor)
