"""What a stage checks of a trainer's weight update before any byte moves, and the session
an update lives in (see ``omnistage.stage.weights.sync``).

A chunk's tensors must be weights of the stage with their exact shape and dtype (a dtype
that differs would be cast silently: only an update that asks, ``convert_dtypes``, may
differ, and only between float dtypes), must be what ``start`` announced if it announced,
and must arrive once; the backend must be able to carry them (gloo has no float8 or int16),
and ``ipc`` handles must be the kind this stage's device can open. Every refusal is an
``InvalidRequestError`` naming the field and the tensor.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl.protocol import (
    CONVERTIBLE,
    GLOO_UNSUPPORTED,
    UpdateInfo,
    dtype_name,
    memcopy_many,
    parse_dtype,
)

Spec = tuple[torch.dtype, list[int]]


@dataclass
class Session:
    """One weight update from ``start`` to ``finish``: who owns it and what has arrived."""

    id: str
    required: bool  # update/finish must name it: its caller asked for that at start
    announced: dict[str, Spec] | None  # what start said the update carries, if it said
    shared: bool = False  # the trainer writes into the staging itself (``staged`` chunks)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    received_bytes: int = 0
    sets: list[Any] = field(default_factory=list)  # its staging sets (``staging``)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # where each one lands


def check_tensors(
    info: UpdateInfo,
    targets: Mapping[str, torch.Tensor],
    session: Session | None,
    *,
    gloo: bool,
    where: str = "update_info",
) -> dict[str, Spec]:
    """Every tensor of ``info`` against the live weights ``targets`` (and, for a chunk of
    ``session``, against what start announced and what already arrived); returns each one's
    dtype and shape by name. ``gloo``: the transfer broadcasts through gloo."""
    specs: dict[str, Spec] = {}
    announced = session.announced if session is not None else None
    for name, dtype_text, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        target, dtype = targets.get(name), parse_dtype(dtype_text)
        if target is None:
            raise InvalidRequestError(f"{where}.names.{name}", "not a weight of this stage")
        if list(target.shape) != shape:
            raise InvalidRequestError(
                f"{where}.shapes.{name}", f"is {shape}, the stage's weight is {list(target.shape)}"
            )
        if dtype != target.dtype and not (
            info.convert_dtypes and {dtype, target.dtype} <= CONVERTIBLE
        ):
            live = dtype_name(target.dtype)
            raise InvalidRequestError(
                f"{where}.dtype_names.{name}",
                f"is {dtype_text}, the stage's weight is {live}; send {live}, or (between "
                "float dtypes) set update_info.convert_dtypes: true to have it cast",
            )
        if gloo and dtype in GLOO_UNSUPPORTED:
            raise InvalidRequestError(
                f"{where}.dtype_names.{name}",
                f"gloo (the nccl backend on CPU) cannot carry {dtype_text}; use backend ipc",
            )
        if announced is not None and announced.get(name) != (dtype, shape):
            said = "was not announced" if name not in announced else "differs from"
            raise InvalidRequestError(
                f"{where}.names.{name}", f"{said} what start_weight_update announced"
            )
        if session is not None and name in session.staged:
            raise InvalidRequestError(f"{where}.names.{name}", "arrived twice in this update")
        specs[name] = (dtype, shape)
    return specs


def check_handles(info: UpdateInfo, backend: str | None, device: torch.device) -> None:
    """``ipc_handles`` present exactly for the ``ipc`` backend, of a kind ``device`` opens."""
    if backend == "nccl":
        if info.ipc_handles is not None:
            raise InvalidRequestError(
                "update_info.ipc_handles", "the nccl backend receives by broadcast; drop them"
            )
        return
    if info.ipc_handles is None:
        raise InvalidRequestError("update_info.ipc_handles", "the ipc backend needs handles")
    if device.type != "cuda" and any("cuda" in h for h in info.ipc_handles):
        raise InvalidRequestError(
            "update_info.ipc_handles",
            f"a CUDA IPC handle, but this stage runs on {device.type}: share CPU tensors as "
            "shared-memory segments ({'shm', 'offset'})",
        )


CHECK_BYTES = 4 << 20  # a read-only check's block
FUSED_BYTES = 1 << 20  # a copy's block, checked while it is still in cache


def _block_finite(block: torch.Tensor) -> bool:
    """Whether a block of floats holds no NaN or Inf: one read (a sum, which any NaN or Inf
    makes non-finite; finite values that overflow it are told apart exactly), no tensor
    of the block's size allocated — ``isfinite(t).all()`` is an order of magnitude slower."""
    if block.element_size() == 1:  # float8: no sum or isfinite kernel; widen the block
        return bool(torch.isfinite(block.float()).all())
    if bool(torch.isfinite(block.sum())):
        return True
    return bool(torch.isfinite(block).all())


def all_finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():
        return True
    flat = tensor.reshape(-1)
    step = max(1, CHECK_BYTES // flat.element_size())
    return all(_block_finite(flat[i : i + step]) for i in range(0, flat.numel(), step))


def _fast(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src`` can go into ``dst`` as bytes by ``memmove`` (host, same layout)."""
    return (
        dst.device.type == "cpu" == src.device.type
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; host bytes by ``memmove`` (``memcopy``)."""
    copy_all([(dst, src)])


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair; host bytes by glibc's ``memmove`` without the GIL,
    shared by two threads (``memcopy_many``): memory speed where torch's two-thread copy
    slows to a crawl on a busy host."""
    fast = []
    for dst, src in pairs:
        if not _fast(dst, src):
            dst.copy_(src)
        elif dst.numel():
            fast.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
    memcopy_many(fast)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``copy_into(dst, src)`` with the NaN/Inf check fused into the same pass: each block is
    checked while it is in cache. False (``dst`` partly written) at the first non-finite
    value of a float tensor."""
    if not _fast(dst, src):
        dst.copy_(src)
        return all_finite(dst)
    if not dst.is_floating_point():
        copy_into(dst, src)
        return True
    size = dst.element_size()
    step = max(1, FUSED_BYTES // size)
    flat, to, frm = dst.reshape(-1), dst.data_ptr(), src.data_ptr()
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        ctypes.memmove(to + i * size, frm + i * size, n * size)
        if not _block_finite(flat[i : i + n]):
            return False
    return True


def refuse_nonfinite(name: str, finite: bool) -> None:
    if not finite:
        raise InvalidRequestError(f"update_info.names.{name}", "has NaN or infinite values")


AHEAD = 2  # tensors a broadcast receive posts ahead of the one being checked


def receive_checked(
    group: Any, named: list[tuple[str, torch.Tensor]], device: torch.device
) -> None:
    """Receive each of ``named`` by broadcast from rank 0 and check it, the receives posted
    ``AHEAD`` of the tensor being checked: a check overlaps the next tensors' receive. A
    tensor with NaN or Inf is refused once the whole chunk is in (the trainer's broadcasts
    all complete, and no receive is left writing into the staging)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pending: list[tuple[str, torch.Tensor, torch.Tensor, Any]] = []
    refused: list[str] = []

    def settle() -> None:
        name, host, landing, work = pending.pop(0)
        work.wait()
        if landing is not host:  # a GPU stage receives on the device
            host.copy_(landing)
        if not refused and not all_finite(landing):
            refused.append(name)

    for name, host in named:
        landing = host  # gloo receives straight into host memory
        if device.type == "cuda":  # never run on a GPU yet
            landing = torch.empty(host.shape, dtype=host.dtype, device=device)
        pending.append((name, host, landing, group.broadcast([landing], opts)))
        if len(pending) > AHEAD:
            settle()
    while pending:
        settle()
    for name in refused:
        refuse_nonfinite(name, False)
