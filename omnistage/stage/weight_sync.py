"""Weights pushed by a trainer without disk — vLLM's weight-transfer protocol, for one worker.

``init_weight_transfer(backend, init_info)`` once: backend ``nccl`` joins a process group with
the trainer (NCCL on CUDA, gloo on CPU) as rank ``rank_offset`` of ``world_size``, the trainer
being rank 0; ``ipc`` (same host) needs nothing: tensors arrive as shared-memory segments on
CPU, CUDA IPC handles on GPU. Then per update ``start_weight_update`` → ``receive_weights``
(one or more chunks, described by names, dtypes and shapes) → ``finish_weight_update``.

Tensors are staged in host memory as they arrive and checked (known names, shapes, finite
values); only ``finish`` copies them into the live weights, in place. A failed or interrupted
update leaves the previous weights serving, and the device never holds the weights twice.
The host buffers are reused: the last update's tensors stay as the level-2 reload source,
the ones before them stage the next update (two host copies at most, faulted in once).
"""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnistage.errors import InvalidRequestError, WeightTransferError
from omnistage.rl.protocol import BACKENDS, UpdateInfo, parse_dtype, weights_checksum

logger = logging.getLogger(__name__)

Targets = Callable[[], Mapping[str, torch.Tensor]]  # live weights by checkpoint name
Apply = Callable[[dict[str, torch.Tensor], str], Any]  # staged tensors, version -> ACK


class WeightSync:
    def __init__(self, stage_id: int, targets: Targets, apply: Apply, device: torch.device) -> None:
        self.stage_id = stage_id
        self._targets = targets
        self._apply = apply
        self.device = device
        self.backend: str | None = None
        self._group: Any = None
        self._staged: dict[str, torch.Tensor] | None = None
        self._received_bytes = 0
        self._live: dict[str, torch.Tensor] = {}  # the last applied update's host tensors
        self._spare: dict[str, torch.Tensor] = {}  # host buffers to stage the next one in
        self._segments = SharedSegments()  # ipc: the segments of the chunk being received

    # -- the protocol ------------------------------------------------------------------

    def init_weight_transfer(
        self, backend: str = "nccl", init_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Join the trainer (``nccl``: blocks until the trainer's rank 0 is there too)."""
        if backend not in BACKENDS:
            raise InvalidRequestError(
                "backend", f"must be one of {list(BACKENDS)}, got {backend!r}"
            )
        info = dict(init_info or {})
        self._group = None
        if backend == "nccl":
            self._group = self._join(info)
        self.backend = backend
        return {"backend": backend, "rank": int(info.get("rank_offset", 1))}

    def _join(self, info: dict[str, Any]) -> Any:
        import torch.distributed as dist

        try:
            host = str(info["master_address"])
            port, world_size = int(info["master_port"]), int(info.get("world_size", 2))
            rank = int(info.get("rank_offset", 1))
            timeout = datetime.timedelta(seconds=float(info.get("timeout_s", 60)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(
                "init_info",
                f"needs master_address, master_port (and world_size, rank_offset): {exc}",
            ) from None
        if not 0 < rank < world_size:
            raise InvalidRequestError("init_info.rank_offset", f"must be in [1, {world_size})")
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            if self.device.type == "cuda":  # never run on a GPU yet
                nccl = dist.ProcessGroupNCCL
                return nccl(store, rank, world_size, nccl.Options())
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as exc:  # the trainer is not there: a failed init, not a dead stage
            raise WeightTransferError(
                f"could not join the trainer at {host}:{port}: {type(exc).__name__}: {exc}"
            ) from None

    def start_weight_update(self, update_info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Begin an update. ``update_info`` may announce every tensor the update will carry:
        they are checked now, before any byte moves, so a trainer learns of a bad name or
        shape before it starts broadcasting (a collective the stage would not join)."""
        if self.backend is None:
            raise InvalidRequestError(
                "backend", "call init_weight_transfer (init_weight_transfer_engine) first"
            )
        if update_info is not None:
            try:
                self._check(UpdateInfo.from_json(update_info))
            except InvalidRequestError:
                raise
            except ValueError as exc:
                raise InvalidRequestError("update_info", str(exc)) from None
        self._staged = {}
        self._received_bytes = 0
        return {"started": True}

    def _check(self, info: UpdateInfo) -> None:
        targets = self._targets()
        for name, shape in zip(info.names, info.shapes, strict=True):
            target = targets.get(name)
            if target is None:
                raise InvalidRequestError(f"update_info.names.{name}", "not a weight of this stage")
            if list(target.shape) != shape:
                raise InvalidRequestError(
                    f"update_info.shapes.{name}",
                    f"is {shape}, the stage's weight is {list(target.shape)}",
                )

    def receive_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Receive one chunk into host staging; a bad description or a broken transfer
        discards the whole update (``start_weight_update`` again to retry)."""
        if self._staged is None:
            raise InvalidRequestError("update_info", "call start_weight_update first")
        try:
            info = UpdateInfo.from_json(update_info)
            targets = self._targets()
            for name, shape in zip(info.names, info.shapes, strict=True):
                target = targets.get(name)
                if target is None:
                    raise InvalidRequestError(
                        f"update_info.names.{name}", "not a weight of this stage"
                    )
                if list(target.shape) != shape:
                    raise InvalidRequestError(
                        f"update_info.shapes.{name}",
                        f"is {shape}, the stage's weight is {list(target.shape)}",
                    )
            for i, (name, dtype, shape) in enumerate(
                zip(info.names, info.dtype_names, info.shapes, strict=True)
            ):
                tensor = self._receive_one(info, i, self._buffer(name, parse_dtype(dtype), shape))
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise InvalidRequestError(
                        f"update_info.names.{name}", "has NaN or infinite values"
                    )
                self._staged[name] = tensor
                self._received_bytes += tensor.numel() * tensor.element_size()
        except ValueError as exc:  # a malformed description (InvalidRequestError is one too)
            self._staged = None
            self._segments.close()
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError("update_info", str(exc)) from None
        except Exception as exc:
            self._staged = None
            self._segments.close()
            if self.backend == "nccl":
                self._group = None  # a broken collective cannot be trusted again
                self.backend = None
            raise WeightTransferError(
                f"the weight transfer broke: {type(exc).__name__}: {exc}; the previous weights "
                "keep serving (init the transfer again before the next update)"
            ) from None
        self._segments.close()
        return {"received_tensors": len(info.names), "received_bytes": self._received_bytes}

    def _buffer(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A host tensor to stage ``name`` in: a spare one of that shape, else a new one."""
        spare = self._spare.pop(name, None)
        if spare is not None and spare.dtype == dtype and list(spare.shape) == shape:
            return spare
        pinned = self.device.type == "cuda"
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def _receive_one(self, info: UpdateInfo, i: int, host: torch.Tensor) -> torch.Tensor:
        if self.backend == "nccl":
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            if self.device.type != "cuda":  # gloo receives straight into host memory
                self._group.broadcast([host], opts).wait()
                return host
            buffer = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            self._group.broadcast([buffer], opts).wait()
            return host.copy_(buffer)
        if info.ipc_handles is None:
            raise InvalidRequestError("update_info.ipc_handles", "the ipc backend needs handles")
        return _from_ipc_handle(info.ipc_handles[i], host, self._segments)

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """Check the staged update is complete enough and apply it in place (the ACK)."""
        if self._staged is None:
            raise InvalidRequestError("weight_version", "no weight update in progress")
        staged, self._staged = self._staged, None
        if not staged:
            raise InvalidRequestError("update_info", "the update carried no tensors")
        version = "" if weight_version is None else str(weight_version)
        try:
            ack = self._apply(staged, version)
        except BaseException:
            self._spare.update(staged)
            raise
        # The applied tensors are now a reload source. When they replaced the whole history,
        # the previous ones are nobody's source any more: they stage the next update.
        sources = getattr(getattr(ack, "metadata", None), "weight_sources", None)
        if sources is not None and len(sources) == 1:
            self._spare.update(self._live)
            self._live = {}
        self._live.update(staged)
        return ack

    def weights_checksum(self) -> str:
        return weights_checksum(self._targets().items())


def _copy_out(buffer: memoryview, offset: int, host: torch.Tensor) -> torch.Tensor:
    """``host`` filled from ``buffer`` at ``offset``; no view outlives the call (the segment
    can then be closed)."""
    nbytes = host.numel() * host.element_size()
    if nbytes:
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
        host.reshape(-1).view(torch.uint8).copy_(flat)
        del flat
    return host


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


def _from_ipc_handle(
    handle: dict[str, Any], host: torch.Tensor, segments: SharedSegments
) -> torch.Tensor:
    """``host`` filled from a tensor the trainer shared: a shared-memory segment on CPU
    (``{"shm", "offset"}``) or a CUDA IPC handle on GPU (``{"cuda": {...}}``)."""
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
    if "cuda" in handle:  # never run on a GPU yet
        spec = handle["cuda"]
        storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            int(spec["device"]),
            base64.b64decode(spec["handle"]),
            int(spec["storage_size"]),
            int(spec["storage_offset"]),
            base64.b64decode(spec["ref_counter_handle"]),
            int(spec["ref_counter_offset"]),
            base64.b64decode(spec["event_handle"]) if spec.get("event_handle") else b"",
            bool(spec.get("event_sync_required", False)),
        )
        tensor = torch.empty(0, dtype=dtype, device=f"cuda:{int(spec['device'])}")
        strides = torch.empty(shape).stride()  # contiguous, as the trainer sends them
        tensor.set_(storage, int(spec.get("tensor_offset", 0)), shape, strides)
        return host.copy_(tensor)
    raise InvalidRequestError("update_info.ipc_handles", "a handle needs 'shm' or 'cuda'")
