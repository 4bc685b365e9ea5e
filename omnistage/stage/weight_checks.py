"""What a stage checks of a trainer's weight update before any byte moves, and the session
an update lives in (see ``omnistage.stage.weight_sync``).

A chunk's tensors must be weights of the stage with their exact shape and dtype (a dtype
that differs would be cast silently: only an update that asks, ``convert_dtypes``, may
differ, and only between float dtypes), must be what ``start`` announced if it announced,
and must arrive once; the backend must be able to carry them (gloo has no float8 or int16),
and ``ipc`` handles must be the kind this stage's device can open. Every refusal is an
``InvalidRequestError`` naming the field and the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl.protocol import (
    CONVERTIBLE,
    GLOO_UNSUPPORTED,
    UpdateInfo,
    dtype_name,
    parse_dtype,
)

Spec = tuple[torch.dtype, list[int]]


@dataclass
class Session:
    """One weight update from ``start`` to ``finish``: who owns it and what has arrived."""

    id: str
    required: bool  # update/finish must name it: its caller asked for that at start
    announced: dict[str, Spec] | None  # what start said the update carries, if it said
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    received_bytes: int = 0


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


def all_finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():
        return True
    if tensor.element_size() == 1:  # float8: no isfinite kernel; check the values widened
        return bool(torch.isfinite(tensor.float()).all())
    return bool(torch.isfinite(tensor).all())
