"""The stage busy loop, independent of transport: take inputs, step the engine, emit outputs.

``StageCore`` turns incoming messages into engine calls and engine results into outgoing
messages. Control operations are typed calls (``ControlCall``), dispatched by type, whose
reply may be deferred: a sleep with mode ``wait`` pauses admission, keeps stepping until the
in-flight requests finish, and only then sleeps and replies (or gives up after
``drain_timeout_s`` and resumes). A handler that returns a ``Background`` (a weight
transfer's receive or rendezvous, on a thread) is answered when its work is done, the loop
serving meanwhile; until then the operations that change memory or weights (``ops.ACKED``:
sleep, wake, update_weights, a sync's finish) wait their turn — answered in order once it is
done, which the transfer's bounded timeout guarantees — while the others answer at once.

Nothing a message carries can end the loop: a request the engine refuses fails that request,
a control call that raises is answered with the error. Only an exception escaping
``engine.step()`` — which engines raise for faults of the process itself — ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from omnistage.errors import InvalidRequestError
from omnistage.stage import control as ops
from omnistage.stage.background import Background
from omnistage.stage.control import Ack
from omnistage.stage.handoff import (
    Handoffs,
    SharedMemoryTransport,
    Transport,
    as_upstream_result,
)
from omnistage.stage.messages import (
    AbortRequest,
    AddRequest,
    AppendInput,
    ControlCall,
    ControlResult,
    DiscardHandoff,
    FromStage,
    Handoff,
    HandoffRef,
    OutputBatch,
    OutputMessage,
    Shutdown,
    StageRequest,
    ToStage,
    WireError,
)
from omnistage.stage.types import StageOutput

logger = logging.getLogger(__name__)


class StageEngine(Protocol):
    """What the core needs from an engine (every kind's implements it)."""

    is_paused: bool

    def add_wire_request(self, request_id: str, request: StageRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[StageOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def is_drained(self) -> bool: ...
    def drain_holders(self) -> list[str]: ...
    def pause(self, mode: str = "abort") -> Any: ...
    def resume(self) -> None: ...
    def sleep(self, level: int = 2, mode: str = "abort", tags: Any = None) -> Ack: ...


class Channel(Protocol):
    def recv(self, timeout_s: float) -> ToStage | None: ...
    def send(self, msg: FromStage) -> None: ...


@dataclasses.dataclass
class _PendingDrain:
    call_id: int
    op: ops.Sleep
    deadline: float
    timeout_s: float


def control_handlers(engine: Any) -> dict[type, Callable[[Any], Any]]:
    """What each control operation does to ``engine``, by the operation's type."""

    def sync() -> Any:
        return engine.weight_sync

    return {
        ops.Sleep: lambda op: engine.sleep(op.level, op.mode, op.tags),
        ops.WakeUp: lambda op: engine.wake_up(op.tags, op.reload, op.resume),
        ops.Pause: lambda op: engine.pause(op.mode),
        ops.Resume: lambda op: engine.resume(),
        ops.UpdateWeights: lambda op: engine.update_weights(op.path, op.check_finite),
        ops.AdoptHistory: lambda op: engine.adopt_history(op.sources, load=op.load),
        ops.Status: lambda op: engine.status(),
        ops.IsSleeping: lambda op: engine.is_sleeping(),
        ops.ResetPrefixCache: lambda op: engine.reset_prefix_cache(),
        ops.InitWeightTransfer: lambda op: sync().init_weight_transfer(
            op.backend, op.init_info, op.abort_open
        ),
        ops.StartWeightUpdate: lambda op: sync().start_weight_update(
            op.update_info, op.require_session, op.abort_open
        ),
        ops.ReceiveWeights: lambda op: sync().receive_weights(op.update_info, op.session),
        ops.FinishWeightUpdate: lambda op: sync().finish_weight_update(
            op.weight_version, op.session
        ),
        ops.AbortWeightUpdate: lambda op: sync().abort_weight_update(op.session),
        ops.WeightsChecksum: lambda op: sync().weights_checksum(),
    }


def to_output_message(out: StageOutput, handoff: HandoffRef | None = None) -> OutputMessage:
    """What the API process gets of an output: never the data a next stage takes (that is
    ``handoff``, where it was left)."""
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
        num_cached_tokens=out.num_cached_tokens,
        handoff=handoff,
        media=list(out.media),
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        queue_time_s=out.queue_time_s,
        delta=Handoff(**out.delta) if out.delta is not None else None,
    )


def upstream_update(msg: AppendInput) -> Any:
    """What an ``EmbedStream`` takes of one ``AppendInput``: the stage before's new token ids
    and what its output added to the hand-off."""
    return as_upstream_result(msg.delta or Handoff(), token_ids=list(msg.token_ids), text="")


def error_result(call_id: int, exc: BaseException) -> ControlResult:
    return ControlResult(call_id=call_id, error=WireError.from_exception(exc))


def value_result(call_id: int, result: Any) -> ControlResult:
    """An ACK leaves the stage as one ACK per rank; anything else as a plain value."""
    if isinstance(result, Ack):
        return ControlResult(call_id=call_id, acks=result.flat())
    return ControlResult(call_id=call_id, value=_plain(result))


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


def open_stream(engine: Any, processor: str, params: dict[str, Any] | None = None) -> Any:
    """The stream of a streamed request's processor, if the engine takes streams: a
    ``TokenStream`` (token ids in) or, for an engine that takes embeddings
    (``STREAM_INPUT = "embeds"``), an ``EmbedStream`` (the stage before's rows in)."""
    from omnistage.models import registry

    if not hasattr(engine, "add_streamed_request"):
        raise InvalidRequestError(
            "stream", f"a {engine.config.kind!r} stage takes no streamed input"
        )
    chosen = registry.processor(processor)
    if getattr(engine, "STREAM_INPUT", "tokens") == "embeds":
        if chosen.stream_embeds is None:
            raise InvalidRequestError("stream", f"processor {processor!r} cannot stream embeddings")
        return chosen.stream_embeds(engine.config.model, params or {})
    if chosen.stream is None:
        raise InvalidRequestError("stream", f"processor {processor!r} cannot stream its input")
    return chosen.stream(engine.config.model)


class StageCore:
    """``transport``: where this stage leaves what it hands the next stage (default: shared
    memory, for stages on one host)."""

    def __init__(
        self, engine: Any, drain_timeout_s: float = 30.0, transport: Transport | None = None
    ) -> None:
        self.engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._pending: _PendingDrain | None = None
        self._running: list[tuple[int, Background[Any]]] = []  # call id, its work
        self._waiting: list[tuple[int, Any]] = []  # ACKED calls held until that work ends
        self._handlers = control_handlers(engine)
        self.handoffs = Handoffs(transport or SharedMemoryTransport(), engine.config.model)
        self._streams: dict[
            str, Any
        ] = {}  # a TokenStream or an EmbedStream  # streamed requests' input, by request

    def has_work(self) -> bool:
        return (
            self._pending is not None
            or bool(self._running or self._waiting)
            or bool(self.engine.has_unfinished_requests())
        )

    def handle(self, msg: ToStage) -> list[FromStage]:
        if isinstance(msg, AddRequest):
            return self._add(msg)
        if isinstance(msg, AppendInput):
            return self._append(msg)
        if isinstance(msg, AbortRequest):
            for request_id in msg.request_ids:
                self.engine.abort(request_id)
                self.handoffs.aborted(request_id)
                self._streams.pop(request_id, None)
            return []  # the aborted outputs come out with the next step
        if isinstance(msg, ControlCall):
            return self._control(msg.call_id, msg.op)
        if isinstance(msg, DiscardHandoff):
            self.handoffs.discard(msg.ref)
            return []
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> list[FromStage]:
        try:
            request = msg.request
            if msg.upstream is not None:
                request = self.handoffs.resolve(request, msg.upstream)
            if msg.stream is not None:
                stream = open_stream(self.engine, msg.stream, msg.params)
                self.engine.add_streamed_request(msg.request_id, request)
                self._streams[msg.request_id] = stream
            else:
                self.engine.add_wire_request(msg.request_id, request)
        except Exception as exc:  # the request fails; the stage keeps serving
            return [failed_request(msg.request_id, exc)]
        if msg.forward:
            self.handoffs.forward(msg.request_id)
        return []

    def _append(self, msg: AppendInput) -> list[FromStage]:
        """Input for a streamed request, through its processor's stream; an input that ends
        it badly fails the request. Input for a request no longer here is dropped."""
        stream = self._streams.get(msg.request_id)
        if stream is None:
            return []
        try:
            if msg.delta is not None or hasattr(stream, "feed_update"):
                update, ended = stream.feed_update(upstream_update(msg), msg.final)
            else:
                update, ended = stream.feed(list(msg.token_ids), msg.final)
            if ended:
                del self._streams[msg.request_id]
            self.engine.append_input(msg.request_id, update, ended)
        except Exception as exc:
            self._streams.pop(msg.request_id, None)
            self.engine.fail_request(msg.request_id, exc)
        return []

    def _control(self, call_id: int, op: Any) -> list[FromStage]:
        if self._running and isinstance(op, ops.ACKED):
            self._waiting.append((call_id, op))
            return []
        # An engine already paused (or asleep) keeps its pause mode: nothing new to drain.
        is_drain = (
            isinstance(op, ops.Sleep)
            and op.mode == "wait"
            and self._pending is None
            and not self.engine.is_paused
        )
        if is_drain:
            try:
                self.engine.pause("wait")
            except Exception as exc:
                return [error_result(call_id, exc)]
            timeout_s = op.drain_timeout_s or self._drain_timeout_s
            self._pending = _PendingDrain(call_id, op, time.monotonic() + timeout_s, timeout_s)
            return self._check_drain()
        try:
            result = self._handlers[type(op)](op)
        except Exception as exc:
            return [*self._flush(), error_result(call_id, exc)]
        if isinstance(result, Background):
            self._running.append((call_id, result))
            return []
        # Outputs the call produced (aborted requests) go out before its reply.
        return [*self._flush(), value_result(call_id, result)]

    def _check_background(self) -> list[FromStage]:
        """Answer the calls whose work is done; then let the held ones through, in order."""
        replies: list[FromStage] = []
        for call_id, work in [item for item in self._running if item[1].ready()]:
            self._running.remove((call_id, work))
            try:
                replies.append(value_result(call_id, work.answer()))
            except Exception as exc:
                replies.append(error_result(call_id, exc))
        while self._waiting and not self._running:
            call_id, op = self._waiting.pop(0)
            replies.extend(self._control(call_id, op))
        return replies

    def _check_drain(self) -> list[FromStage]:
        pending = self._pending
        if pending is None:
            return []
        if self.engine.is_drained():
            self._pending = None
            try:
                result = self._handlers[ops.Sleep](pending.op)
            except Exception as exc:
                return [*self._flush(), error_result(pending.call_id, exc)]
            return [*self._flush(), value_result(pending.call_id, result)]
        if time.monotonic() > pending.deadline:
            self._pending = None
            holders = self.engine.drain_holders()
            self.engine.resume()
            named = ", ".join(holders[:5]) + (
                f" and {len(holders) - 5} more" if holders[5:] else ""
            )
            timeout = TimeoutError(
                f"sleep(mode='wait') gave up: requests still running after {pending.timeout_s:g}s"
                + (f" ({named})" if named else "")
                + "; raise drain_timeout_s or sleep with mode 'abort' or 'keep'"
            )
            return [error_result(pending.call_id, timeout)]
        return []

    def step(self) -> list[FromStage]:
        msgs = self._flush() if self.engine.has_unfinished_requests() else []
        return [*msgs, *self._check_drain(), *self._check_background()]

    def _flush(self) -> list[FromStage]:
        outputs = self.engine.step()
        if not outputs:
            return []
        for out in outputs:
            if out.finished:  # a streamed request that ended early takes no more input
                self._streams.pop(out.request_id, None)
        return [OutputBatch([to_output_message(o, self.handoffs.observe(o)) for o in outputs])]

    def serve(self, channel: Channel, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Run until a ``Shutdown`` message arrives or ``should_stop()`` says so."""
        try:
            self._serve(channel, should_stop)
        finally:
            self.handoffs.close()

    def _serve(self, channel: Channel, should_stop: Callable[[], bool]) -> None:
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
                made_progress = bool(replies) or self.engine.has_runnable_work()
                for reply in replies:
                    channel.send(reply)


def _plain(value: Any) -> Any:
    """Dataclasses in status replies become dicts msgpack can carry."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
