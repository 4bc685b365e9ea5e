"""Messages between the engine client (API process) and a stage process.

Every message is a msgspec struct encoded as msgpack; tensors travel as a msgpack extension
(raw bytes + dtype + shape). Requests are validated in the API process and arrive as typed
structs; replies carry typed ACKs and errors as data (class name, message, field). The module
lives in the stage layer because both sides import it and the stage layer must not import
the engine client.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import msgspec
import torch

from omnistage.errors import error_fields, rebuild_error
from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.code2wav.params import AudioOutput, Code2WavLimits, Code2WavParams
from omnistage.stage.diffusion.params import DiffusionParams, ImageOutput, PipelineLimits
from omnistage.stage.startup import StartupOptions as StartupOptions  # re-exported
from omnistage.stage.startup import decode_startup as decode_startup
from omnistage.stage.startup import encode_startup as encode_startup

_TENSOR_EXT = 1


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


# -- requests (validated in the API process) ----------------------------------------------


class ARStageRequest(msgspec.Struct, tag="ar", forbid_unknown_fields=True):
    """A tokenized prompt for an AR stage. ``prompt`` is the text, for the record only.

    For a stage fed by another (the Qwen2.5-Omni talker): ``prompt_embeds`` ``[L, E]`` are the
    prompt's input embeddings (the ids then count only for lengths and penalties; positions
    from ``token_embeds_from`` on add their token's embedding too) and
    ``decode_embeds`` ``[R, E]`` are added to the embedding of the token fed at decode step
    ``j`` (row ``min(j, R - 1)``). For a stage feeding one (the thinker):
    ``hidden_states_with_embeddings`` returns each position's final hidden state plus its
    input embedding, and ``embed_token_ids`` asks for those ids' embeddings
    (``token_embeddings`` in the finished output)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_hidden_states: bool = False
    prompt: str | None = None
    hidden_states_with_embeddings: bool = False
    embed_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None
    token_embeds_from: int | None = None  # prompt positions from here add their tokens' too
    decode_embeds: torch.Tensor | None = None


class DiffusionStageRequest(msgspec.Struct, tag="diffusion", forbid_unknown_fields=True):
    """A text prompt or conditioning embeddings ``[seq, dim]`` for a diffusion stage."""

    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    params: DiffusionParams = msgspec.field(default_factory=DiffusionParams)


class Code2WavStageRequest(msgspec.Struct, tag="code2wav", forbid_unknown_fields=True):
    """Speech-codec tokens (without the end token) for a code2wav stage to speak."""

    codes: list[int]
    params: Code2WavParams = msgspec.field(default_factory=Code2WavParams)


StageRequest = ARStageRequest | DiffusionStageRequest | Code2WavStageRequest


# -- API process -> stage ------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    request: StageRequest


class AbortRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    """A control operation (``sleep``, ``wake_up``, ...) with its keyword arguments."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag=True):
    pass


ToStage = AddRequest | AbortRequest | UtilityCall | Shutdown


# -- stage -> API process -------------------------------------------------------------------


class AckMetadata(msgspec.Struct):
    """What an operation did, measured (vLLM-Omni's ``OmniACK.metadata`` plus omnistage's)."""

    level: int | None = None
    mode: str | None = None
    tags: list[str] = []
    latency_ms: float = 0.0
    cuda_graph_recalled: bool = False
    host_backup_bytes: int = 0
    restored_bytes: int = 0
    # Achieved GB/s: a wake's restored_bytes over its latency_ms; a level-1 sleep's bytes
    # offloaded over the arena's time for them. 0.0 where nothing was moved.
    gbps: float = 0.0
    reload_gbps: float = 0.0  # a wake that reloaded discarded weights: bytes read / reload time
    resident_bytes_before: int = 0
    resident_bytes_after: int = 0
    aborted: int = 0
    preempted: int = 0
    sleeping_tags: list[str] = []
    weights_valid: bool = True
    weight_sources: list[str] | None = None  # after a weight update: what a reload replays
    weight_version: str | None = None  # after a weight sync: the trainer's version


SYNC_PREFIX = "sync:"  # how weights a trainer pushed show in ``weight_sources``


class Ack(msgspec.Struct):
    """The reply to a sleep, wake or weight update, shaped like vLLM-Omni's ``OmniACK``."""

    task_id: str
    status: str  # SUCCESS | ERROR | SKIPPED
    stage_id: int
    rank: int = 0
    freed_bytes: int = 0
    error_msg: str | None = None
    metadata: AckMetadata = msgspec.field(default_factory=AckMetadata)
    # A tensor-parallel stage: the ACKs of ranks 1..N-1 (this one is rank 0's, its status
    # the whole stage's). Listed beside it, one per rank, in HTTP replies.
    rank_acks: list[Ack] = []

    def to_dict(self) -> dict[str, Any]:
        return dict(msgspec.to_builtins(self))


_task_ids = itertools.count(1)


def make_ack(
    stage_id: int,
    *,
    status: str = "SUCCESS",
    rank: int = 0,
    freed_bytes: int = 0,
    error_msg: str | None = None,
    **metadata: Any,
) -> Ack:
    """An ACK shaped like vLLM-Omni's ``OmniACK`` with omnistage's metadata."""
    return Ack(
        task_id=f"omni-{stage_id}-{os.getpid()}-{next(_task_ids)}",
        status=status,
        stage_id=stage_id,
        rank=rank,
        freed_bytes=max(0, int(freed_bytes)),
        error_msg=error_msg,
        metadata=AckMetadata(**metadata),
    )


class UtilityResult(msgspec.Struct, tag=True):
    """The reply to a ``UtilityCall``: an ACK, a plain value (status, flags), or an error."""

    call_id: int
    ack: Ack | None = None
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
    finished AR request that asked for them carries ``hidden_states``; a finished diffusion
    request carries ``images``. ``logprobs`` has one entry per new token when asked for;
    ``prompt_logprobs`` comes once, with the first output (``None`` for the first token)."""

    request_id: str
    index: int = 0
    text_delta: str = ""
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    error: WireError | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    hidden_states: torch.Tensor | None = None
    token_embeddings: torch.Tensor | None = None  # of the request's ``embed_token_ids``
    images: list[ImageOutput] = []
    audio: list[AudioOutput] = []
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queue_time_s: float | None = None  # on a request's first output: its wait to be scheduled


class OutputBatch(msgspec.Struct, tag=True):
    outputs: list[OutputMessage]


class ARStageInfo(msgspec.Struct, tag="ar"):
    """What the API process needs to validate requests for an AR stage."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int = 1
    embedding_size: int = 0  # width of input embeddings a request may bring
    emits_text: bool = True  # False: its tokens are codes (a talker)


class DiffusionStageInfo(msgspec.Struct, tag="diffusion"):
    """What the API process needs to validate requests for a diffusion stage."""

    limits: PipelineLimits


class Code2WavStageInfo(msgspec.Struct, tag="code2wav"):
    """What the API process needs to validate requests for a code2wav stage."""

    limits: Code2WavLimits


StageInfo = ARStageInfo | DiffusionStageInfo | Code2WavStageInfo


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


FromStage = OutputBatch | UtilityResult | Ready | StartupFailed | Heartbeat


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


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_stage = msgspec.msgpack.Decoder(ToStage, ext_hook=_ext_hook, dec_hook=_dec_hook)
_from_stage = msgspec.msgpack.Decoder(FromStage, ext_hook=_ext_hook, dec_hook=_dec_hook)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_stage(data: bytes) -> ToStage:
    return _to_stage.decode(data)


def decode_from_stage(data: bytes) -> FromStage:
    return _from_stage.decode(data)
