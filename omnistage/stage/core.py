"""The stage busy loop, independent of transport: take inputs, step the engine, emit outputs.

``StageCore`` turns incoming messages into engine calls and engine results into outgoing
messages. Control operations are utility calls whose reply may be deferred: a sleep with
mode ``wait`` pauses admission, keeps stepping until the in-flight requests finish, and only
then sleeps and replies (or gives up after ``drain_timeout_s`` and resumes).

Nothing a message carries can end the loop: a request the engine refuses fails that request,
a utility call that raises is answered with the error. Only an exception escaping
``engine.step()`` — which engines raise for faults of the process itself — ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from omnistage.errors import InvalidRequestError
from omnistage.stage.messages import (
    AbortRequest,
    Ack,
    AddRequest,
    FromStage,
    OutputBatch,
    OutputMessage,
    Shutdown,
    StageRequest,
    ToStage,
    UtilityCall,
    UtilityResult,
    WireError,
)
from omnistage.stage.types import StageOutput

logger = logging.getLogger(__name__)

UTILITY_METHODS = frozenset(
    {
        "sleep",
        "wake_up",
        "pause",
        "resume",
        "update_weights",
        "status",
        "is_sleeping",
        "reset_prefix_cache",
    }
)
# The weight-transfer protocol, served by the engine's ``weight_sync``.
WEIGHT_SYNC_METHODS = frozenset(
    {
        "init_weight_transfer",
        "start_weight_update",
        "receive_weights",
        "finish_weight_update",
        "weights_checksum",
    }
)


class StageEngine(Protocol):
    """What the core needs from an engine (both kinds implement it)."""

    is_paused: bool

    def add_wire_request(self, request_id: str, request: StageRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[StageOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def is_drained(self) -> bool: ...
    def pause(self, mode: str = "abort") -> Any: ...
    def resume(self) -> None: ...
    def sleep(self, level: int = 2, mode: str = "abort", tags: Any = None) -> Ack: ...


class Channel(Protocol):
    def recv(self, timeout_s: float) -> ToStage | None: ...
    def send(self, msg: FromStage) -> None: ...


@dataclasses.dataclass
class _PendingDrain:
    call_id: int
    args: dict[str, Any]
    deadline: float
    timeout_s: float


def to_output_message(out: StageOutput) -> OutputMessage:
    payload = out.payload or {}
    return OutputMessage(
        request_id=out.request_id,
        index=out.index,
        text_delta=out.text_delta,
        new_token_ids=list(out.new_token_ids),
        finished=out.finished,
        finish_reason=out.finish_reason,
        error=WireError.from_exception(out.error) if out.error is not None else None,
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        hidden_states=payload.get("hidden_states"),
        token_embeddings=payload.get("token_embeddings"),
        images=list(payload.get("images") or []),
        audio=list(payload.get("audio") or []),
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        queue_time_s=out.queue_time_s,
    )


def error_result(call_id: int, exc: BaseException) -> UtilityResult:
    return UtilityResult(call_id=call_id, error=WireError.from_exception(exc))


def value_result(call_id: int, result: Any) -> UtilityResult:
    if isinstance(result, Ack):
        return UtilityResult(call_id=call_id, ack=result)
    return UtilityResult(call_id=call_id, value=result)


def failed_request(request_id: str, exc: BaseException) -> OutputBatch:
    """The one output of a request the stage refused."""
    return OutputBatch(
        [
            OutputMessage(
                request_id=request_id,
                finished=True,
                finish_reason="error",
                error=WireError.from_exception(exc),
            )
        ]
    )


class StageCore:
    def __init__(self, engine: Any, drain_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._pending: _PendingDrain | None = None

    def has_work(self) -> bool:
        return self._pending is not None or bool(self.engine.has_unfinished_requests())

    def handle(self, msg: ToStage) -> list[FromStage]:
        if isinstance(msg, AddRequest):
            return self._add(msg)
        if isinstance(msg, AbortRequest):
            for request_id in msg.request_ids:
                self.engine.abort(request_id)
            return []  # the aborted outputs come out with the next step
        if isinstance(msg, UtilityCall):
            return self._utility(msg)
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> list[FromStage]:
        try:
            self.engine.add_wire_request(msg.request_id, msg.request)
        except Exception as exc:  # the request fails; the stage keeps serving
            return [failed_request(msg.request_id, exc)]
        return []

    def _utility(self, call: UtilityCall) -> list[FromStage]:
        if call.method not in UTILITY_METHODS | WEIGHT_SYNC_METHODS:
            return [
                error_result(
                    call.call_id, InvalidRequestError("method", f"unknown utility {call.method!r}")
                )
            ]
        args = dict(call.args)
        drain_timeout_s = float(args.pop("drain_timeout_s", self._drain_timeout_s))
        # An engine already paused (or asleep) keeps its pause mode: nothing new to drain.
        if (
            call.method == "sleep"
            and args.get("mode") == "wait"
            and self._pending is None
            and not self.engine.is_paused
        ):
            try:
                self.engine.pause("wait")
            except Exception as exc:
                return [error_result(call.call_id, exc)]
            self._pending = _PendingDrain(
                call.call_id, args, time.monotonic() + drain_timeout_s, drain_timeout_s
            )
            return self._check_drain()
        owner = self.engine.weight_sync if call.method in WEIGHT_SYNC_METHODS else self.engine
        try:
            result = getattr(owner, call.method)(**args)
        except Exception as exc:
            return [*self._flush(), error_result(call.call_id, exc)]
        # Outputs the call produced (aborted requests) go out before its reply.
        return [*self._flush(), value_result(call.call_id, _plain(result))]

    def _check_drain(self) -> list[FromStage]:
        pending = self._pending
        if pending is None:
            return []
        if self.engine.is_drained():
            self._pending = None
            try:
                result = self.engine.sleep(**pending.args)
            except Exception as exc:
                return [*self._flush(), error_result(pending.call_id, exc)]
            return [*self._flush(), value_result(pending.call_id, result)]
        if time.monotonic() > pending.deadline:
            self._pending = None
            self.engine.resume()
            timeout = TimeoutError(
                f"sleep(mode='wait') gave up: requests still running after {pending.timeout_s:g}s; "
                "raise drain_timeout_s or sleep with mode 'abort' or 'keep'"
            )
            return [error_result(pending.call_id, timeout)]
        return []

    def step(self) -> list[FromStage]:
        msgs = self._flush() if self.engine.has_unfinished_requests() else []
        return [*msgs, *self._check_drain()]

    def _flush(self) -> list[FromStage]:
        outputs = self.engine.step()
        return [OutputBatch([to_output_message(o) for o in outputs])] if outputs else []

    def serve(self, channel: Channel, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Run until a ``Shutdown`` message arrives or ``should_stop()`` says so."""
        made_progress = False
        while not should_stop():
            # Poll without waiting while work moves; back off a little when the engine holds
            # requests it cannot schedule (paused with kept requests), idle otherwise.
            timeout = 0.05 if not self.has_work() else (0.0 if made_progress else 0.005)
            msg = channel.recv(timeout)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    return
                for reply in self.handle(msg):
                    channel.send(reply)
                msg = channel.recv(0.0)
            made_progress = False
            if self.has_work():
                replies = self.step()
                # A multi-step batch mid-way has nothing to send yet but is progressing.
                runnable = getattr(self.engine, "has_runnable_work", None)
                made_progress = bool(replies) or (runnable is not None and runnable())
                for reply in replies:
                    channel.send(reply)


def _plain(value: Any) -> Any:
    """Dataclasses in status replies become dicts msgpack can carry."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
