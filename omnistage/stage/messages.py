"""Messages between the engine client (API process) and a stage process.

All of them are msgspec structs encoded as msgpack; tensors travel as a msgpack extension
(raw bytes + dtype + shape). The module lives in the stage layer because both sides import
it and the stage layer must not import the engine client.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import torch

_TENSOR_EXT = 1


class AddRequest(msgspec.Struct, tag=True):
    """``request`` holds the kind-specific fields (see ``omnistage.stage.requests``)."""

    request_id: str
    request: dict[str, Any]


class AbortRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag=True):
    pass


class UtilityResult(msgspec.Struct, tag=True):
    """Errors cross the boundary as data: the type name, message and offending field."""

    call_id: int
    result: Any = None
    error_type: str | None = None
    error_message: str | None = None
    error_field: str | None = None


class OutputMessage(msgspec.Struct, tag=True):
    request_id: str
    text_delta: str = ""
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_type: str | None = None
    error_field: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    payload: dict[str, Any] | None = None


class OutputBatch(msgspec.Struct, tag=True):
    outputs: list[OutputMessage]


class Ready(msgspec.Struct, tag=True):
    stage_id: int
    kind: str
    pid: int
    info: dict[str, Any] = {}


class StartupFailed(msgspec.Struct, tag=True):
    stage_id: int
    error: str


ToStage = AddRequest | AbortRequest | UtilityCall | Shutdown
FromStage = OutputBatch | UtilityResult | Ready | StartupFailed


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        header = json.dumps(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        ).encode()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR_EXT, len(header).to_bytes(4, "little") + header + raw)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to or from a stage process")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    header = json.loads(bytes(data[4 : 4 + n]))
    dtype = getattr(torch, header["dtype"])
    raw = bytearray(data[4 + n :])
    if not raw:
        return torch.empty(header["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(header["shape"])


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_stage = msgspec.msgpack.Decoder(ToStage, ext_hook=_ext_hook)
_from_stage = msgspec.msgpack.Decoder(FromStage, ext_hook=_ext_hook)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_stage(data: bytes) -> ToStage:
    return _to_stage.decode(data)


def decode_from_stage(data: bytes) -> FromStage:
    return _from_stage.decode(data)
