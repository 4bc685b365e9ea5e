"""Where a stage runs, behind one seam: a ``StageLauncher`` starts a stage and hands back a
``StageHandle`` that carries messages to it and reports when it goes away.

``LocalProcessLauncher`` spawns the stage as a process of this machine and talks ZMQ over
ipc://; ``InProcessLauncher`` runs the same ``StageCore`` loop on a thread of this process
(tests, single-process use). A launcher for another placement (Ray actors, tcp://) is one
more implementation; nothing above this module knows which one runs.

A handle reports the end of its stage once, through ``on_exit(reason)``: the process exited
(with its exit code or signal), or its heartbeats stopped (``heartbeat_timeout_s``; the
process is then killed), or the in-process thread died.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from omnistage.config import StageConfig
from omnistage.engine.spawn import SpawnedStage, spawn_stage
from omnistage.errors import StageDeadError, StageStartupError
from omnistage.stage.messages import (
    FromStage,
    Heartbeat,
    Ready,
    Shutdown,
    StageInfo,
    StartupFailed,
    StartupOptions,
    ToStage,
    decode_from_stage,
    encode,
)
from omnistage.stage.startup import stop_process

Deliver = Callable[[FromStage], None]
OnExit = Callable[[str], None]


class StageHandle(Protocol):
    """One running instance of a stage."""

    @property
    def pid(self) -> int | None: ...

    def wait_ready(self) -> StageInfo:
        """Block until the stage reports ready (``StageStartupError`` if it cannot start)."""
        ...

    def run(self, deliver: Deliver, on_exit: OnExit) -> None:
        """Start delivering the stage's messages (from a thread) and watching its life."""
        ...

    def send(self, msg: ToStage) -> None:
        """Send without blocking; ``StageDeadError`` if the stage is gone."""
        ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


class StageLauncher(Protocol):
    def launch(self, config: StageConfig, options: StartupOptions) -> StageHandle:
        """Start the stage (returns at once; ``wait_ready`` on the handle blocks)."""
        ...


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 1`` / ``killed by SIGKILL`` / ``exit status unknown``."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class ProcessStageHandle:
    """A stage in a spawned process of this machine, reached over ipc:// sockets."""

    def __init__(
        self,
        config: StageConfig,
        options: StartupOptions,
        *,
        num_threads: int,
        ready_timeout_s: float,
        heartbeat_timeout_s: float,
        spawned: SpawnedStage | None = None,
    ) -> None:
        if spawned is None:
            spawned = spawn_stage(config, options, num_threads)
        self.stage_id = config.stage_id
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ipc_dir = spawned.ipc_dir
        self._ctx = spawned.ctx
        self._to_stage = spawned.to_stage
        self._from_stage = spawned.from_stage
        self.process = spawned.process
        self._send_lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._waiting_ready = False
        self._receiver: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._last_heard = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def wait_ready(self) -> StageInfo:
        self._waiting_ready = True
        try:
            return self._wait_ready()
        finally:
            self._waiting_ready = False
            if self._closing:  # shut down meanwhile: the sockets are this thread's to close
                self._close_sockets()

    def _wait_ready(self) -> StageInfo:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self._closing:
                raise StageStartupError(f"stage {self.stage_id} was shut down while starting")
            if self._from_stage.poll(100):
                msg = decode_from_stage(self._from_stage.recv())
                if isinstance(msg, Ready):
                    self._last_heard = time.monotonic()
                    return msg.info
                if isinstance(msg, StartupFailed):
                    self.shutdown()
                    raise StageStartupError(f"stage {self.stage_id} failed to start: {msg.error}")
            if not self.process.is_alive():
                self.process.join(1.0)
                how = describe_exit(self.process.exitcode)
                self.shutdown()
                raise StageStartupError(
                    f"stage {self.stage_id} process {how} during start-up"
                )  # fmt: skip
            if time.monotonic() > deadline:
                self.shutdown()
                raise StageStartupError(
                    f"stage {self.stage_id} not ready after {self.ready_timeout_s:g}s; "
                    "raise stage_init_timeout_s (--stage-init-timeout-s)"
                )

    def run(self, deliver: Deliver, on_exit: OnExit) -> None:
        self._receiver = threading.Thread(
            target=self._receive_loop,
            args=(deliver,),
            name=f"stage{self.stage_id}-recv",
            daemon=True,
        )
        self._receiver.start()
        self._watcher = threading.Thread(
            target=self._watch, args=(on_exit,), name=f"stage{self.stage_id}-watch", daemon=True
        )
        self._watcher.start()

    def _receive_loop(self, deliver: Deliver) -> None:
        sock = self._from_stage
        while not self._closing:
            try:
                if not sock.poll(100):
                    continue
                data = sock.recv()
            except zmq.ZMQError:
                return
            self._last_heard = time.monotonic()
            msg = decode_from_stage(data)
            if not isinstance(msg, Heartbeat):
                deliver(msg)

    def _watch(self, on_exit: OnExit) -> None:
        process = self.process
        while not self._closing:
            if multiprocessing.connection.wait([process.sentinel], timeout=1.0):
                process.join(5.0)  # reaped, so the exit code is known
                if not self._closing:
                    on_exit(f"process {process.pid} {describe_exit(process.exitcode)}")
                return
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self.heartbeat_timeout_s and not self._closing:
                with contextlib.suppress(OSError):
                    process.kill()
                process.join(5.0)
                on_exit(f"process {process.pid} sent no heartbeat for {silent_s:.0f}s (killed)")
                return

    def send(self, msg: ToStage) -> None:
        data = encode(msg)
        with self._send_lock:
            if self._closing:
                raise StageDeadError(self.stage_id, "shut down")
            # A PUSH socket without a connected peer blocks a plain send forever, and the peer
            # is gone the moment the stage process dies, before the watcher says so.
            try:
                self._to_stage.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if not self.process.is_alive() or not self._to_stage.poll(1000, zmq.POLLOUT):
                raise StageDeadError(self.stage_id, "stage process not connected")
            self._to_stage.send(data, zmq.NOBLOCK)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the stage process (politely, then by force) and release the sockets."""
        if self._closing:
            return
        process = self.process
        if process.is_alive() and not self._waiting_ready:
            with contextlib.suppress(zmq.ZMQError, StageDeadError):
                self.send(Shutdown())
        self._closing = True
        stop_process(process, timeout_s if not self._waiting_ready else 0)
        # ZMQ sockets are not thread-safe: the receiver (it sees ``_closing`` within a poll
        # period) must be done with its socket before the socket is closed, and a thread
        # still waiting for the handshake closes them itself.
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(2.0)
        if not self._waiting_ready:
            self._close_sockets()

    def _close_sockets(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._to_stage.close(linger=0)
            self._from_stage.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class LocalProcessLauncher:
    """Each stage in a process of its own on this machine.

    ``prestarted`` (``spawn.prestart``): stages already spawned, awake and fresh, that the
    first launch of each takes over instead of spawning another (restarts spawn anew)."""

    def __init__(
        self,
        num_threads: Callable[[StageConfig], int],
        ready_timeout_s: float = 600.0,
        heartbeat_timeout_s: float = 60.0,
        prestarted: dict[int, SpawnedStage] | None = None,
    ) -> None:
        self.num_threads = num_threads
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.prestarted = prestarted if prestarted is not None else {}

    def launch(self, config: StageConfig, options: StartupOptions) -> ProcessStageHandle:
        spawned = None
        if options == StartupOptions() and config.replica_id == 0:  # prestart's: replica 0's
            spawned = self.prestarted.pop(config.stage_id, None)
        return ProcessStageHandle(
            config,
            options,
            num_threads=self.num_threads(config),
            ready_timeout_s=self.ready_timeout_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            spawned=spawned,
        )


class _QueueChannel:
    def __init__(self) -> None:
        self.inbox: queue.Queue[ToStage] = queue.Queue()
        self.deliver: Deliver = lambda msg: None

    def recv(self, timeout_s: float) -> ToStage | None:
        try:
            return self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, msg: FromStage) -> None:
        self.deliver(msg)


class ThreadStageHandle:
    """The stage engine on a thread of this process; same contract, no sockets."""

    def __init__(self, config: StageConfig, options: StartupOptions, engine: Any = None) -> None:
        self.config = config
        self.options = options
        self.engine = engine
        self._channel = _QueueChannel()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def wait_ready(self) -> StageInfo:
        from omnistage.stage.proc import build_engine, restore

        try:
            if self.engine is None:
                self.engine = build_engine(self.config, self.options)
            else:
                restore(self.engine, self.options)
        except Exception as exc:
            raise StageStartupError(
                f"stage {self.config.stage_id} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        info: StageInfo = self.engine.info()
        return info

    def run(self, deliver: Deliver, on_exit: OnExit) -> None:
        from omnistage.stage.core import StageCore

        self._channel.deliver = deliver
        core = StageCore(self.engine, drain_timeout_s=self.config.drain_timeout_s)

        def serve() -> None:
            try:
                core.serve(self._channel)
            except Exception as exc:  # an engine crash is a dead stage, as with a process
                on_exit(f"{type(exc).__name__}: {exc}")
            finally:
                # On this thread, as the stage process does: never under a step still running.
                self.engine.shutdown()

        self._thread = threading.Thread(
            target=serve, name=f"stage{self.config.stage_id}-inproc", daemon=True
        )
        self._thread.start()

    def send(self, msg: ToStage) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise StageDeadError(self.config.stage_id, "stage thread is not running")
        self._channel.inbox.put(msg)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the stage thread; it shuts the engine down when its current step ends."""
        if self._thread is None:
            if self.engine is not None:
                self.engine.shutdown()
            return
        if self._thread.is_alive():
            with contextlib.suppress(StageDeadError):  # it ended meanwhile
                self.send(Shutdown())
            self._thread.join(timeout_s)


class InProcessLauncher:
    """Stages on threads of this process. ``engines`` maps stage ids to prebuilt engines
    (used for their first start only: a restart builds a fresh one)."""

    def __init__(self, engines: dict[int, Any] | None = None) -> None:
        self._engines = dict(engines or {})

    def launch(self, config: StageConfig, options: StartupOptions) -> ThreadStageHandle:
        return ThreadStageHandle(config, options, self._engines.pop(config.stage_id, None))
