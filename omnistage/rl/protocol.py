"""What a trainer and a stage agree on to move weights without disk: dtype names, the
update description (vLLM's ``update_info``: names, dtype names, shapes, and for the ``ipc``
backend where each tensor sits in shared memory), and a weights checksum.

Imports torch only: both sides use it, the trainer without any server code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS = ("nccl", "ipc")
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class UpdateInfo:
    """One chunk of a weight update: per tensor its name, dtype and shape, in the order the
    trainer sends them. ``ipc_handles`` (backend ``ipc``) says where each one is."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
        }
        if self.ipc_handles is not None:
            data["ipc_handles"] = self.ipc_handles
        return data

    @classmethod
    def from_json(cls, data: object) -> UpdateInfo:
        """Parse and check an update description (``ValueError`` naming the bad field)."""
        if not isinstance(data, dict):
            raise ValueError("update_info: must be an object")
        names, dtypes, shapes = data.get("names"), data.get("dtype_names"), data.get("shapes")
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ValueError("update_info.names: must be a list of names")
        if not isinstance(dtypes, list) or len(dtypes) != len(names):
            raise ValueError("update_info.dtype_names: must give one dtype per name")
        for name in dtypes:
            parse_dtype(name)
        if not isinstance(shapes, list) or len(shapes) != len(names):
            raise ValueError("update_info.shapes: must give one shape per name")
        for shape in shapes:
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
            ):
                raise ValueError(f"update_info.shapes: {shape!r} is not a list of sizes")
        if len(set(names)) != len(names):
            raise ValueError("update_info.names: a name appears twice")
        handles = data.get("ipc_handles")
        if handles is not None and (
            not isinstance(handles, list)
            or len(handles) != len(names)
            or not all(isinstance(h, dict) for h in handles)
        ):
            raise ValueError("update_info.ipc_handles: must give one handle object per name")
        return cls(list(names), list(dtypes), [list(s) for s in shapes], handles)

    def nbytes(self) -> int:
        total = 0
        for dtype, shape in zip(self.dtype_names, self.shapes, strict=True):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * parse_dtype(dtype).itemsize
        return total


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every tensor, by name order: its name, dtype, shape and bytes. Equal on
    the trainer and on the stage exactly when they hold the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach()
        digest.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        digest.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
