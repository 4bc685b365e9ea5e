"""Messages between the engine client (API process) and a stage process.

Every message is a msgspec struct encoded as msgpack; tensors travel as a msgpack extension
(raw bytes + dtype + shape). Requests are validated in the API process and arrive as typed
structs (each kind's from its package, assembled by ``omnistage.stage.kinds``); control
operations are typed too (``omnistage.stage.control``); replies carry typed ACKs and errors as
data (class name, message, field). The module lives in the stage layer because both sides
import it and the stage layer must not import the engine client.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from omnistage.errors import error_fields, rebuild_error
from omnistage.stage.control import Ack, ControlOp
from omnistage.stage.kinds import wire_unions
from omnistage.stage.startup import StartupOptions as StartupOptions  # re-exported
from omnistage.stage.startup import decode_startup as decode_startup
from omnistage.stage.startup import encode_startup as encode_startup

_TENSOR_EXT = 1

if TYPE_CHECKING:
    StageRequest = Any
    StageInfo = Any
    MediaOutput = Any
else:
    StageRequest, StageInfo, MediaOutput = wire_unions()


class WireError(msgspec.Struct):
    """An exception as data: its class name, message and the request field it names."""

    type: str
    message: str
    field: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> WireError:
        return cls(*error_fields(exc))

    def rebuild(self, stage_id: int) -> Exception:
        return rebuild_error(stage_id, self.type, self.message, self.field)


# -- stage to stage (see ``omnistage.stage.handoff``) --------------------------------------


class HandoffRef(msgspec.Struct, frozen=True):
    """Where a stage left one request's payload for the next stage."""

    transport: str
    key: str
    address: str = ""  # socket: the producer's server
    nbytes: int = 0


class Handoff(msgspec.Struct):
    """A finished request's output, as the next stage's processor takes it."""

    text: str = ""
    token_ids: list[int] = []
    hidden_states: torch.Tensor | None = None
    token_embeddings: torch.Tensor | None = None
    num_prompt_tokens: int = 0
    positions: torch.Tensor | None = None  # the prompt's multimodal rotary positions
    position_delta: int = 0
    prompt_token_ids: list[int] = []  # with hidden states: the prompt they are of
    # a streamed edge's first input: the ids the next stage takes before the generated ones (a
    # cloned voice's reference codes; a whole hand-off puts them in ``token_ids``)
    context_token_ids: list[int] = []


class Upstream(msgspec.Struct, frozen=True):
    """A request's input from the stage before: its payload and the processor to run on it."""

    ref: HandoffRef
    processor: str
    params: dict[str, dict[str, Any]] = {}  # the request's parameters, for the processor


# -- API process -> stage ------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    """A request for the stage. ``forward``: hand its finished output to the next stage
    (a ``HandoffRef`` comes back instead of the data); ``upstream``: its prompt is what the
    stage before handed over, through the processor named there; ``stream``: its input comes
    later, in ``AppendInput`` messages, through the stream of the processor named here."""

    request_id: str
    request: StageRequest
    forward: bool = False
    upstream: Upstream | None = None
    stream: str | None = None
    params: dict[str, dict[str, Any]] = {}  # with ``stream``: the request's, for its processor


class AppendInput(msgspec.Struct, tag=True):
    """More input for a streamed request: what the stage before produced since the last
    (``final`` with its last)."""

    request_id: str
    token_ids: list[int]
    final: bool = False
    delta: Handoff | None = None  # what the stage before's output added to its hand-off


class DiscardHandoff(msgspec.Struct, tag=True):
    """A payload this stage handed over that no stage will take (its request ended)."""

    ref: HandoffRef


class AbortRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class ControlCall(msgspec.Struct, tag=True):
    """A control operation (``Sleep``, ``WakeUp``, ...), answered by a ``ControlResult``."""

    call_id: int
    op: ControlOp


class Shutdown(msgspec.Struct, tag=True):
    pass


ToStage = AddRequest | AppendInput | AbortRequest | ControlCall | DiscardHandoff | Shutdown


# -- stage -> API process -------------------------------------------------------------------


class ControlResult(msgspec.Struct, tag=True):
    """The reply to a ``ControlCall``: ACKs (one per rank, rank 0's first), a plain value
    (status, flags), or an error."""

    call_id: int
    acks: list[Ack] | None = None
    value: Any = None
    error: WireError | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The logprobs at one position: the chosen token first (with its rank in the
    distribution, 1 = most likely), then the top k in rank order; ``tokens`` are their texts."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    tokens: list[str]


class OutputMessage(msgspec.Struct, tag=True):
    """One update of one sample (``index``) of a request; ``finished`` on its last. A
    finished request that a next stage takes carries where its output was left for it
    (``handoff``); a finished media request carries its ``media`` (images, waveforms);
    ``hidden_states`` only when a client asked for them (the offline API). ``logprobs`` has
    one entry per new token when asked for; ``prompt_logprobs`` comes once, with the first
    output (``None`` for the first token)."""

    request_id: str
    index: int = 0
    text_delta: str = ""
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    error: WireError | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    hidden_states: torch.Tensor | None = None
    handoff: HandoffRef | None = None
    media: list[MediaOutput] = []
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queue_time_s: float | None = None  # on a request's first output: its wait to be scheduled
    delta: Handoff | None = None  # a streamed edge's input (``StageOutput.delta``)


class OutputBatch(msgspec.Struct, tag=True):
    outputs: list[OutputMessage]


class Ready(msgspec.Struct, tag=True):
    stage_id: int
    kind: str
    pid: int
    info: StageInfo


class StartupFailed(msgspec.Struct, tag=True):
    stage_id: int
    error: str


class Heartbeat(msgspec.Struct, tag=True):
    """Sent by a stage process every ``heartbeat_interval_s`` from a thread of its own."""

    stage_id: int


FromStage = OutputBatch | ControlResult | Ready | StartupFailed | Heartbeat


# -- encoding ------------------------------------------------------------------------------


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
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a tensor dtype: {header['dtype']!r}")
    raw = bytearray(data[4 + n :])
    if not raw:
        return torch.empty(header["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(header["shape"])


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise NotImplementedError(f"cannot decode {type_.__name__}")


def decoder(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    """A msgpack decoder of ``type_`` that takes tensors as this module sends them."""
    return msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook, dec_hook=_dec_hook)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_stage = decoder(ToStage)
_from_stage = decoder(FromStage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_stage(data: bytes) -> ToStage:
    return _to_stage.decode(data)


def decode_from_stage(data: bytes) -> FromStage:
    return _from_stage.decode(data)
