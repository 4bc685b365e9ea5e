"""One client per stage: submit requests, receive outputs, make utility calls.

``StageProcClient`` runs the stage in its own process (spawn) and talks ZMQ over ipc://;
``InProcStageClient`` runs the same ``StageCore`` loop on a thread of this process, for unit
tests and single-process use. Both deliver outputs to per-request asyncio queues on the event
loop they are attached to, and both fail every open request with ``StageDeadError`` when the
stage goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq

from omnistage import errors
from omnistage.config import StageConfig
from omnistage.stage.messages import (
    AbortRequest,
    AddRequest,
    FromStage,
    OutputBatch,
    OutputMessage,
    Ready,
    Shutdown,
    StartupFailed,
    ToStage,
    UtilityCall,
    UtilityResult,
    decode_from_stage,
    encode,
)


class StageStartupError(errors.OmnistageError):
    """A stage process failed to start or did not report ready in time."""


def rebuild_error(
    stage_id: int, error_type: str | None, message: str, field: str | None
) -> Exception:
    """Turn an error that crossed the process boundary back into the matching exception."""
    if error_type == "InvalidRequestError":
        exc: Exception = errors.InvalidRequestError(field or "request", message.split(": ", 1)[-1])
    elif error_type == "WeightsInvalidError":
        exc = errors.WeightsInvalidError(stage_id)
    elif error_type == "StageAsleepError":
        exc = errors.StageAsleepError(stage_id, message)
    elif error_type == "StageDeadError":
        exc = errors.StageDeadError(stage_id, message)
    elif error_type == "SleepModeDisabledError":
        exc = errors.SleepModeDisabledError(stage_id)
    elif error_type in ("ValueError", "TypeError"):
        exc = ValueError(message)
    elif error_type == "TimeoutError":
        exc = TimeoutError(message)
    else:
        exc = errors.OmnistageError(f"stage {stage_id}: {error_type}: {message}")
    return exc


def oversized_int_field(value: Any, path: str = "") -> str | None:
    """The path of the first integer msgpack cannot carry (outside ``[-2**63, 2**64)``), if any."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(2**63) <= value < 2**64 else path or "request"
    items: Any = value.items() if isinstance(value, dict) else ()
    if isinstance(value, list | tuple):
        items = ((None, v) for v in value)
    for key, item in items:
        found = oversized_int_field(item, path if key is None else f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


class _StageClientBase:
    """Request queues, utility futures and death handling shared by both transports."""

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.stage_id = config.stage_id
        self.kind = config.kind
        self.info: dict[str, Any] = {}
        self.is_dead = False
        self.death_reason = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[OutputMessage]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._death_callbacks: list[Any] = []

    # -- transport hooks -----------------------------------------------------------------

    def _send(self, msg: ToStage) -> None:
        raise NotImplementedError

    # -- loop side -----------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(f"stage {self.stage_id} client is bound to another event loop")
        return loop

    def _deliver(self, msg: FromStage) -> None:
        """Called from the receiving thread; hands the message to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing
                loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: FromStage) -> None:
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
        elif isinstance(msg, UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is None or fut.done():
                return
            if msg.error_type is None:
                fut.set_result(msg.result)
            else:
                fut.set_exception(
                    rebuild_error(
                        self.stage_id, msg.error_type, msg.error_message or "", msg.error_field
                    )
                )

    def _mark_dead(self, reason: str) -> None:
        if self.is_dead:
            return
        self.is_dead = True
        self.death_reason = reason
        for request_id, q in list(self._queues.items()):
            q.put_nowait(
                OutputMessage(
                    request_id=request_id,
                    finished=True,
                    finish_reason="error",
                    error=reason,
                    error_type="StageDeadError",
                )
            )
        self._queues.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(errors.StageDeadError(self.stage_id, reason))
        self._calls.clear()
        for callback in self._death_callbacks:
            callback(self.stage_id)

    def _report_death(self, reason: str) -> None:
        """From a watcher thread: mark the stage dead on the event loop (failing its open
        requests), or just flag it when no loop is attached yet."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._mark_dead, reason)
                return
        self.is_dead, self.death_reason = True, reason

    def on_death(self, callback: Any) -> None:
        self._death_callbacks.append(callback)

    # -- public API (event loop) ----------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def add_request(self, request_id: str, request: dict[str, Any]) -> asyncio.Queue[OutputMessage]:
        self._attach()
        if self.is_dead:
            raise errors.StageDeadError(self.stage_id, self.death_reason)
        if request_id in self._queues:
            raise errors.InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        field = oversized_int_field(request)
        if field is not None:  # refused here by both transports, not as a failed encode
            raise errors.InvalidRequestError(field, "integer out of range (64 bits at most)")
        self._send(AddRequest(request_id=request_id, request=request))
        q: asyncio.Queue[OutputMessage] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def abort(self, request_ids: list[str]) -> None:
        """Best effort (callers abort from ``finally`` blocks): a gone stage has nothing to free."""
        if not self.is_dead and request_ids:
            with contextlib.suppress(errors.StageDeadError):
                self._send(AbortRequest(request_ids=request_ids))

    async def call(self, method: str, **args: Any) -> Any:
        loop = self._attach()
        if self.is_dead:
            raise errors.StageDeadError(self.stage_id, self.death_reason)
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id=call_id, method=method, args=args))
        fut: asyncio.Future[Any] = loop.create_future()
        self._calls[call_id] = fut
        return await fut


class StageProcClient(_StageClientBase):
    def __init__(
        self, config: StageConfig, num_threads: int = 1, ready_timeout_s: float = 300.0
    ) -> None:
        super().__init__(config)
        self.num_threads = num_threads
        self.ready_timeout_s = ready_timeout_s
        self.process: multiprocessing.process.BaseProcess | None = None
        self._ipc_dir = ""
        self._ctx: zmq.Context[Any] | None = None
        self._to_stage: zmq.Socket[Any] | None = None
        self._from_stage: zmq.Socket[Any] | None = None
        self._send_lock = threading.Lock()
        self._closing = False
        self._receiver: threading.Thread | None = None

    def start(self) -> None:
        """Spawn the stage process (returns at once); ``wait_ready`` blocks for its handshake."""
        from omnistage.stage.proc import stage_main

        self._ipc_dir = tempfile.mkdtemp(prefix=f"omnistage-stage{self.stage_id}-")
        in_addr = f"ipc://{self._ipc_dir}/in"
        out_addr = f"ipc://{self._ipc_dir}/out"
        self._ctx = zmq.Context()
        self._to_stage = self._ctx.socket(zmq.PUSH)
        self._to_stage.setsockopt(zmq.LINGER, 0)
        # No high-water mark: sends never block the event loop on a busy stage, and a send
        # that would block can only mean the stage is gone (see ``_send``).
        self._to_stage.setsockopt(zmq.SNDHWM, 0)
        self._to_stage.bind(in_addr)
        self._from_stage = self._ctx.socket(zmq.PULL)
        self._from_stage.setsockopt(zmq.LINGER, 0)
        self._from_stage.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=stage_main,
            args=(self.config.model_dump_json(), in_addr, out_addr, self.num_threads),
            name=f"omnistage-stage-{self.stage_id}",
            daemon=True,
        )
        self.process.start()

    def wait_ready(self) -> None:
        if self.process is None or self._from_stage is None:
            raise StageStartupError(f"stage {self.stage_id} was not started")
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self._from_stage.poll(100):
                msg = decode_from_stage(self._from_stage.recv())
                if isinstance(msg, Ready):
                    self.info = msg.info
                    break
                if isinstance(msg, StartupFailed):
                    self.shutdown()
                    raise StageStartupError(f"stage {self.stage_id} failed to start: {msg.error}")
            if not self.process.is_alive():
                code = self.process.exitcode
                self.shutdown()
                raise StageStartupError(
                    f"stage {self.stage_id} process exited during start-up (exit code {code})"
                )
            if time.monotonic() > deadline:
                self.shutdown()
                raise StageStartupError(
                    f"stage {self.stage_id} not ready after {self.ready_timeout_s:g}s; "
                    "raise stage_init_timeout_s (--stage-init-timeout)"
                )
        self._receiver = threading.Thread(
            target=self._receive_loop, name=f"stage{self.stage_id}-recv", daemon=True
        )
        self._receiver.start()
        threading.Thread(
            target=self._watch_process, name=f"stage{self.stage_id}-watch", daemon=True
        ).start()

    def _receive_loop(self) -> None:
        sock = self._from_stage
        while sock is not None and not self._closing:
            try:
                if not sock.poll(100):
                    continue
                data = sock.recv()
            except zmq.ZMQError:
                return
            self._deliver(decode_from_stage(data))

    def _watch_process(self) -> None:
        process = self.process
        if process is None:
            return
        multiprocessing.connection.wait([process.sentinel])
        if not self._closing:
            self._report_death(f"process {process.pid} exited with code {process.exitcode}")

    def _send(self, msg: ToStage) -> None:
        if self._to_stage is None:
            raise errors.StageDeadError(self.stage_id, "not started")
        data = encode(msg)
        with self._send_lock:
            # A PUSH socket without a connected peer blocks a plain send forever, and the peer
            # is gone the moment the stage process dies, before the watcher says so.
            try:
                self._to_stage.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            alive = self.process is not None and self.process.is_alive()
            if not alive or not self._to_stage.poll(1000, zmq.POLLOUT):  # or still connecting
                raise errors.StageDeadError(self.stage_id, "stage process not connected")
            self._to_stage.send(data, zmq.NOBLOCK)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the stage process (politely, then by force) and release the sockets."""
        if self._closing:
            return
        self._closing = True
        process = self.process
        if process is not None and process.is_alive():
            with contextlib.suppress(zmq.ZMQError, errors.OmnistageError):
                self._send(Shutdown())
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        # ZMQ sockets are not thread-safe: the receiver (it sees ``_closing`` within a poll
        # period) must be done with its socket before the socket is closed.
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(2.0)
        for sock in (self._to_stage, self._from_stage):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._to_stage = self._from_stage = None
        self._ctx = None
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class _QueueChannel:
    def __init__(self, client: InProcStageClient) -> None:
        self.inbox: queue.Queue[ToStage] = queue.Queue()
        self._client = client

    def recv(self, timeout_s: float) -> ToStage | None:
        try:
            return self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, msg: FromStage) -> None:
        self._client._deliver(msg)


class InProcStageClient(_StageClientBase):
    """The stage engine on a thread of this process; same interface, no sockets."""

    def __init__(self, config: StageConfig, engine: Any = None) -> None:
        super().__init__(config)
        self._engine = engine
        self._channel = _QueueChannel(self)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from omnistage.stage.core import StageCore
        from omnistage.stage.proc import build_engine
        from omnistage.stage.requests import request_builder

        if self._engine is None:
            self._engine, build_request = build_engine(self.config)
        else:
            build_request = request_builder(self.config.kind, self._engine)
        self.info = self._engine.status()
        core = StageCore(self._engine, build_request, drain_timeout_s=self.config.drain_timeout_s)
        self._thread = threading.Thread(
            target=self._run, args=(core,), name=f"stage{self.stage_id}-inproc", daemon=True
        )
        self._thread.start()

    def wait_ready(self) -> None:
        pass

    def _run(self, core: Any) -> None:
        try:
            core.serve(self._channel)
        except Exception as exc:  # an engine crash is a dead stage, as with a process
            self._report_death(f"{type(exc).__name__}: {exc}")
        finally:
            # On this thread, as the stage process does: never under a step still running.
            self._engine.shutdown()

    def _send(self, msg: ToStage) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise errors.StageDeadError(self.stage_id, "stage thread is not running")
        self._channel.inbox.put(msg)

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the stage thread; it shuts the engine down when its current step ends."""
        if self._thread is None:
            if self._engine is not None:
                self._engine.shutdown()
            return
        if self._thread.is_alive():
            with contextlib.suppress(errors.StageDeadError):  # it ended meanwhile
                self._send(Shutdown())
            self._thread.join(timeout_s)
