"""One client per stage: submit requests, receive outputs, make control calls.

``StageClient`` is transport-agnostic: a ``StageLauncher`` starts the stage and gives back a
``StageHandle`` (a local process over ZMQ, or a thread of this process). Outputs go to
per-request asyncio queues on the event loop the client is attached to. When the stage goes
away every open request and call fails with ``StageDeadError`` at once, and the death
listeners are told; death is not final — ``start`` again (a restart) attaches a new handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from omnistage import errors
from omnistage.config import StageConfig
from omnistage.engine.launcher import StageHandle, StageLauncher
from omnistage.stage.control import ControlOp
from omnistage.stage.messages import (
    AbortRequest,
    AddRequest,
    AppendInput,
    ControlCall,
    ControlResult,
    DiscardHandoff,
    FromStage,
    HandoffRef,
    OutputBatch,
    OutputMessage,
    StageInfo,
    StageRequest,
    StartupOptions,
    ToStage,
    Upstream,
    WireError,
)

logger = logging.getLogger(__name__)


class EngineStageClient(Protocol):
    """What ``AsyncOmni`` needs from a stage client (tests implement it with fakes)."""

    stage_id: int
    kind: str
    info: StageInfo | None
    is_dead: bool
    death_reason: str

    @property
    def num_in_flight(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    def on_death(self, callback: Callable[[int], bool]) -> None: ...
    def attach(self) -> None: ...
    def add_request(
        self,
        request_id: str,
        request: StageRequest,
        *,
        forward: bool = False,
        upstream: Upstream | None = None,
        stream: str | None = None,
        params: dict[str, dict[str, Any]] | None = None,
    ) -> asyncio.Queue[OutputMessage]: ...
    def append_input(
        self, request_id: str, token_ids: list[int], final: bool, delta: Any = None
    ) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def discard(self, ref: HandoffRef) -> None: ...
    async def call(self, op: ControlOp) -> Any: ...
    async def restart(self, options: StartupOptions) -> None: ...
    def shutdown(self) -> None: ...


class StageClient:
    def __init__(self, config: StageConfig, launcher: StageLauncher) -> None:
        self.config = config
        self.stage_id = config.stage_id
        self.kind: str = config.kind
        self.launcher = launcher
        self.info: StageInfo | None = None
        self.is_dead = True  # until a handle reports ready
        self.death_reason = "not started"
        self._handle: StageHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[OutputMessage]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> samples not finished yet
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._death_callbacks: list[Callable[[int], bool]] = []

    # -- life ----------------------------------------------------------------------------

    def start(self, options: StartupOptions | None = None) -> None:
        """Launch the stage (returns at once); ``wait_ready`` blocks for its handshake."""
        self._handle = self.launcher.launch(self.config, options or StartupOptions())

    def wait_ready(self) -> None:
        handle = self._handle
        if handle is None:
            raise errors.StageStartupError(f"stage {self.stage_id} was not started")
        self.info = handle.wait_ready()
        self.is_dead, self.death_reason = False, ""
        handle.run(
            deliver=lambda msg: self._deliver(handle, msg),
            on_exit=lambda reason: self._report_death(handle, reason),
        )

    async def restart(self, options: StartupOptions) -> None:
        """Start a new instance of the stage (after a death) and wait until it is ready.

        The process is spawned from the event loop's thread: a stage process dies with the
        thread that spawned it (parent-death signal), and this one lives as long as the loop.
        """
        self._attach()
        if self._handle is not None:
            await asyncio.to_thread(self._handle.shutdown)
        self.start(options)
        try:
            await asyncio.to_thread(self.wait_ready)
        except BaseException:
            if self._handle is not None:
                await asyncio.to_thread(self._handle.shutdown)
            raise

    @property
    def pid(self) -> int | None:
        return self._handle.pid if self._handle is not None else None

    @property
    def exit_code(self) -> int | None:
        """How the stage's last process ended, when known (negative: the signal)."""
        return getattr(self._handle, "exitcode", None)

    def shutdown(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.shutdown()
        self.is_dead, self.death_reason = True, "shut down"

    # -- loop side -----------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(f"stage {self.stage_id} client is bound to another event loop")
        return loop

    def _deliver(self, handle: StageHandle, msg: FromStage) -> None:
        """From the handle's receiving thread: hand the message to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing
                loop.call_soon_threadsafe(self._dispatch, handle, msg)

    def _dispatch(self, handle: StageHandle, msg: FromStage) -> None:
        if handle is not self._handle:
            return  # a message from an instance that has died since
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                    if out.finished:
                        self._unfinished[out.request_id] -= 1
                        if not self._unfinished[out.request_id] or out.error is not None:
                            del self._queues[out.request_id], self._unfinished[out.request_id]
        elif isinstance(msg, ControlResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is None or fut.done():
                return
            if msg.error is not None:
                fut.set_exception(msg.error.rebuild(self.stage_id))
            else:
                fut.set_result(msg.acks if msg.acks is not None else msg.value)

    def _report_death(self, handle: StageHandle, reason: str) -> None:
        """From a watcher thread: mark the stage dead on the event loop (failing its open
        requests), or just flag it when no loop is attached yet."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._mark_dead, handle, reason)
                return
        if handle is self._handle:
            self.is_dead, self.death_reason = True, reason

    def attach(self) -> None:
        """Bind to the running loop now; a stage that died before is reported dead now."""
        self._attach()
        if self._handle is not None and self.is_dead and self.death_reason:
            reason, self.is_dead = self.death_reason, False
            self._mark_dead(self._handle, reason)

    def _mark_dead(self, handle: StageHandle, reason: str) -> None:
        if handle is not self._handle or self.is_dead:
            return
        # The death listeners (the supervisor) log it for operators, with what happens next,
        # and say whether the stage comes back: its requests are failed saying so.
        logger.debug("stage %d died: %s", self.stage_id, reason)
        self.is_dead, self.death_reason = True, reason
        comes_back = any([callback(self.stage_id) for callback in self._death_callbacks])
        gone = errors.StageRestartingError if comes_back else errors.StageDeadError
        error = WireError.from_exception(gone(self.stage_id, reason))
        for request_id, q in list(self._queues.items()):
            q.put_nowait(
                OutputMessage(
                    request_id=request_id, finished=True, finish_reason="error", error=error
                )
            )
        self._queues.clear()
        self._unfinished.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(gone(self.stage_id, reason))
        self._calls.clear()

    def on_death(self, callback: Callable[[int], bool]) -> None:
        """``callback(stage_id)`` when the stage dies, before its open requests are failed;
        it answers whether the stage will come back (a restart), which the failed requests
        then say (``stage_restarting``, with ``Retry-After``)."""
        self._death_callbacks.append(callback)

    # -- requests and calls (event loop) --------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def holds(self, request_id: str) -> bool:
        """Whether the request is in flight here (its last output not seen yet)."""
        return request_id in self._queues

    def _send(self, msg: ToStage) -> None:
        if self._handle is None or self.is_dead:
            raise errors.StageDeadError(self.stage_id, self.death_reason)
        self._handle.send(msg)

    def add_request(
        self,
        request_id: str,
        request: StageRequest,
        *,
        forward: bool = False,
        upstream: Upstream | None = None,
        stream: str | None = None,
        params: dict[str, dict[str, Any]] | None = None,
    ) -> asyncio.Queue[OutputMessage]:
        """Submit a request; its outputs arrive on the returned queue, the last one (of the
        last of its samples, or an error) with ``finished``. ``forward``: the stage hands its
        finished output to the next stage; ``upstream``: its prompt is what the stage before
        handed over."""
        self._attach()
        if request_id in self._queues:
            raise errors.InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        self._send(
            AddRequest(
                request_id,
                request,
                forward=forward,
                upstream=upstream,
                stream=stream,
                params=params or {},
            )
        )
        q: asyncio.Queue[OutputMessage] = asyncio.Queue()
        self._queues[request_id] = q
        sampling = getattr(request, "sampling_params", None)
        self._unfinished[request_id] = sampling.n if sampling is not None else 1
        return q

    def abort(self, request_ids: list[str]) -> None:
        """Best effort (callers abort from ``finally`` blocks): a gone stage has nothing to free."""
        if request_ids:
            with contextlib.suppress(errors.StageDeadError):
                self._send(AbortRequest(request_ids=request_ids))

    def append_input(
        self, request_id: str, token_ids: list[int], final: bool, delta: Any = None
    ) -> None:
        """More input for a streamed request (best effort: a gone stage fails the request)."""
        with contextlib.suppress(errors.StageDeadError):
            self._send(AppendInput(request_id, token_ids, final, delta))

    def discard(self, ref: HandoffRef) -> None:
        """Best effort: a hand-off no stage will take (a gone stage took its memory along)."""
        with contextlib.suppress(errors.StageDeadError):
            self._send(DiscardHandoff(ref))

    async def call(self, op: ControlOp) -> Any:
        """A control operation: its ACKs (one per rank, rank 0's first) or its value; the
        stage's error is raised as its own class."""
        loop = self._attach()
        call_id = next(self._call_ids)
        self._send(ControlCall(call_id=call_id, op=op))
        fut: asyncio.Future[Any] = loop.create_future()
        self._calls[call_id] = fut
        return await fut
