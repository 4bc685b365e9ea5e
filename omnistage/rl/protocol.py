"""What a trainer and a stage agree on to move weights without disk: dtype names, the
update description (vLLM's ``update_info``: names, dtype names, shapes, and for the ``ipc``
backend where each tensor sits in shared memory — or ``staged``: in the stage's own shared
staging, which ``start`` answers when asked with ``shared_staging``), the ``nccl`` backend's ``init_info``, the
bounds every value keeps (timeouts, versions), and a weights checksum.

Imports torch (and omnistage's error classes) only: both sides use it, the trainer without
any server code. A bad value raises ``InvalidRequestError`` naming its field — a
``ValueError``, which a trainer may catch as such.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl.bounds import DEFAULT_TIMEOUT_S, check_timeout

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


# What gloo (the nccl backend on CPU) cannot broadcast: "Invalid scalar type" mid-transfer.
GLOO_UNSUPPORTED = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.int16})
# Dtypes an update may convert between when it asks to (``convert_dtypes``): only floats,
# where a cast keeps the value's meaning; an int or bool is never a float weight.
CONVERTIBLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
MAX_WORLD_SIZE = 4096


def _int(data: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int:
    value = data.get(key, default)
    if isinstance(value, str) and value.isdigit():  # a port or rank sent as a string
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"init_info.{key}", f"must be an integer, got {value!r:.40}")
    if not low <= value <= high:
        raise InvalidRequestError(f"init_info.{key}", f"must be in [{low}, {high}], got {value}")
    return value


@dataclass(frozen=True)
class InitInfo:
    """The ``nccl`` backend's ``init_info``: where the trainer's store listens, the group's
    size, the stage's rank in it (the trainer is rank 0) and the transfer's timeout."""

    master_address: str
    master_port: int
    world_size: int = 2
    rank_offset: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_json(cls, data: object) -> InitInfo:
        """Parse and bound it (``InvalidRequestError`` naming the field)."""
        if not isinstance(data, dict):
            raise InvalidRequestError("init_info", "must be an object")
        address = data.get("master_address")
        if not isinstance(address, str) or not 0 < len(address) <= 255:
            raise InvalidRequestError("init_info.master_address", "must be a host name or address")
        world_size = _int(data, "world_size", 2, 2, MAX_WORLD_SIZE)
        return cls(
            master_address=address,
            master_port=_int(data, "master_port", None, 1, 65535),
            world_size=world_size,
            rank_offset=_int(data, "rank_offset", 1, 1, world_size - 1),
            timeout_s=check_timeout(data.get("timeout_s", DEFAULT_TIMEOUT_S)),
        )


@dataclass
class UpdateInfo:
    """One chunk of a weight update: per tensor its name, dtype and shape, in the order the
    trainer sends them. ``ipc_handles`` (backend ``ipc``) says where each one is;
    ``convert_dtypes`` lets a floating-point dtype differ from the weight's (cast on apply)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, Any]] | None = None
    convert_dtypes: bool = False
    shared_staging: bool = False  # at start (ipc): answer where to write each tensor
    staged: bool = False  # a chunk written into the stage's shared staging (no handles)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
        }
        if self.ipc_handles is not None:
            data["ipc_handles"] = self.ipc_handles
        for flag in ("convert_dtypes", "shared_staging", "staged"):
            if getattr(self, flag):
                data[flag] = True
        return data

    @classmethod
    def from_json(cls, data: object) -> UpdateInfo:
        """Parse and check an update description (``InvalidRequestError`` — a ``ValueError``
        — naming the bad field)."""
        if not isinstance(data, dict):
            raise InvalidRequestError("update_info", "must be an object")
        names, dtypes, shapes = data.get("names"), data.get("dtype_names"), data.get("shapes")
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise InvalidRequestError("update_info.names", "must be a list of names")
        if not isinstance(dtypes, list) or len(dtypes) != len(names):
            raise InvalidRequestError("update_info.dtype_names", "must give one dtype per name")
        for name, dtype in zip(names, dtypes, strict=True):
            try:
                parse_dtype(dtype)
            except ValueError as exc:
                raise InvalidRequestError(f"update_info.dtype_names.{name}", str(exc)) from None
        if not isinstance(shapes, list) or len(shapes) != len(names):
            raise InvalidRequestError("update_info.shapes", "must give one shape per name")
        for name, shape in zip(names, shapes, strict=True):
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
            ):
                raise InvalidRequestError(
                    f"update_info.shapes.{name}", f"{shape!r:.80} is not a list of sizes"
                )
        if len(set(names)) != len(names):
            raise InvalidRequestError("update_info.names", "a name appears twice")
        flags = {}
        for flag in ("convert_dtypes", "shared_staging", "staged"):
            flags[flag] = data.get(flag, False)
            if not isinstance(flags[flag], bool):
                raise InvalidRequestError(f"update_info.{flag}", "must be true or false")
        handles = data.get("ipc_handles")
        if handles is not None:
            _check_handles(handles, len(names))
            if flags["staged"]:
                raise InvalidRequestError(
                    "update_info.ipc_handles", "a staged chunk is in the stage's staging: drop them"
                )
        return cls(list(names), list(dtypes), [list(s) for s in shapes], handles, **flags)

    def nbytes(self) -> int:
        total = 0
        for dtype, shape in zip(self.dtype_names, self.shapes, strict=True):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * parse_dtype(dtype).itemsize
        return total


def _check_handles(handles: object, count: int) -> None:
    """One handle per tensor: ``{"shm": name, "offset": n}`` or ``{"cuda": {...}}``."""
    field = "update_info.ipc_handles"
    if not isinstance(handles, list) or len(handles) != count:
        raise InvalidRequestError(field, "must give one handle object per name")
    for handle in handles:
        if not isinstance(handle, dict) or ("shm" in handle) == ("cuda" in handle):
            raise InvalidRequestError(field, "each handle needs exactly one of 'shm' or 'cuda'")
        if "shm" in handle:
            name, offset = handle["shm"], handle.get("offset", 0)
            if not isinstance(name, str) or not 0 < len(name) <= 255:
                raise InvalidRequestError(field, "'shm' must name a shared-memory segment")
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise InvalidRequestError(field, "'offset' must be a byte offset (>= 0)")
        elif not isinstance(handle["cuda"], dict):
            raise InvalidRequestError(field, "'cuda' must be a CUDA IPC handle object")


SPLIT_BYTES = 16 << 20  # a copy this large runs on two threads
_helper: Any = None


def memcopy(dst: int, src: int, nbytes: int) -> None:
    """``nbytes`` from address ``src`` to ``dst`` (non-overlapping); see ``memcopy_many``."""
    memcopy_many([(dst, src, nbytes)])


def memcopy_many(copies: list[tuple[int, int, int]]) -> None:
    """Each ``(dst, src, nbytes)`` (non-overlapping) with glibc's ``memmove``, without the
    GIL; from ``SPLIT_BYTES`` in all, in two halves on two threads where the host has two
    cores. Faster than torch's ``copy_`` of the same bytes, and it does not slow to a crawl
    when the host is busy (torch's two OpenMP threads do)."""
    global _helper
    total = sum(n for _, _, n in copies)
    if total < SPLIT_BYTES or (os.cpu_count() or 1) < 2:
        for dst, src, nbytes in copies:
            ctypes.memmove(dst, src, nbytes)
        return
    halves: list[list[tuple[int, int, int]]] = [[], []]
    done, half = 0, total // 2
    for dst, src, nbytes in copies:  # the first half's bytes, then the second's
        cut = min(nbytes, max(0, half - done))
        if cut:
            halves[0].append((dst, src, cut))
        if nbytes > cut:
            halves[1].append((dst + cut, src + cut, nbytes - cut))
        done += nbytes
    if _helper is None:
        from concurrent.futures import ThreadPoolExecutor

        _helper = ThreadPoolExecutor(1, thread_name_prefix="omnistage-copy")
    other = _helper.submit(_run, halves[1])
    _run(halves[0])
    other.result()


def _run(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every tensor, by name order: its name, dtype, shape and bytes. Equal on
    the trainer and on the stage exactly when they hold the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach()
        digest.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        digest.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
