"""The stage process: one OS process per stage, owning its device, arena and engine.

Started with multiprocessing ``spawn`` by a launcher in the engine client. It connects two
ZMQ sockets (requests and control calls in, outputs and replies out), builds its engine —
importing only what its kind needs — brings it to the state its ``StartupOptions`` ask for (a
restarted stage comes back asleep, paused, with its weight updates), announces itself with
``Ready`` (or ``StartupFailed``), and runs the ``StageCore`` loop until told to shut down or
its parent goes away. A thread of its own sends a ``Heartbeat`` every second.

First thing, it takes a title operators can read in ``ps`` and ``top``
(``omnistage-stage0-thinker``) and logs as the server does (``omnistage.logs``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.logs import configure_from_env
from omnistage.stage.messages import (
    ControlResult,
    FromStage,
    Heartbeat,
    Ready,
    StartupFailed,
    StartupOptions,
    ToStage,
    WireError,
    decode_startup,
    decode_to_stage,
    encode,
)

logger = logging.getLogger(__name__)
IS_STAGE_PROCESS = False  # set by ``stage_main``: this process is a stage's, nobody else's


class ZmqChannel:
    def __init__(self, in_addr: str, out_addr: str) -> None:
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.connect(in_addr)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.connect(out_addr)
        self._out_addr = out_addr

    def recv(self, timeout_s: float) -> ToStage | None:
        while self._in.poll(int(timeout_s * 1000)):
            data = self._in.recv()
            try:
                return decode_to_stage(data)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                self._refuse(data, exc)  # answered if it can be, never fatal
                timeout_s = 0.0
        return None

    def _refuse(self, data: bytes, exc: Exception) -> None:
        """Answer a message that does not decode, if it names what to answer."""
        logger.error("stage received a message it cannot decode: %s", exc)
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            return
        if not isinstance(raw, dict):
            return
        error = InvalidRequestError("request", f"malformed message: {exc}")
        if raw.get("type") == "AddRequest" and isinstance(raw.get("request_id"), str):
            from omnistage.stage.core import failed_request

            self.send(failed_request(raw["request_id"], error))
        elif raw.get("type") == "ControlCall" and isinstance(raw.get("call_id"), int):
            self.send(ControlResult(call_id=raw["call_id"], error=WireError.from_exception(error)))

    def send(self, msg: FromStage) -> None:
        self._out.send(encode(msg))

    def start_heartbeat(self, stage_id: int, interval_s: float) -> threading.Event:
        """Send ``Heartbeat`` every ``interval_s`` from a thread with a socket of its own."""
        stop = threading.Event()

        def beat() -> None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(self._out_addr)
            data = encode(Heartbeat(stage_id=stage_id))
            try:
                while not stop.wait(interval_s):
                    # The engine client busy or gone: the next beat tries again.
                    with contextlib.suppress(zmq.Again):
                        sock.send(data, zmq.NOBLOCK)
            finally:
                sock.close()

        threading.Thread(target=beat, name=f"stage{stage_id}-heartbeat", daemon=True).start()
        return stop

    def close(self) -> None:
        self._in.close(linger=0)
        self._out.close()
        self._ctx.term()


def build_engine(config: StageConfig, options: StartupOptions | None = None) -> Any:
    """The engine for ``config.kind``, in the state ``options`` describe."""
    from omnistage.stage.kinds import stage_kind

    options = options or StartupOptions()
    engine = stage_kind(config.kind).build_engine(config, load_weights=options.sleep_level != 2)
    try:
        restore(engine, options)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def restore(engine: Any, options: StartupOptions) -> None:
    """Bring a fresh engine to the state a previous process of its stage was in."""
    if options.weight_sources:
        engine.adopt_history(options.weight_sources, load=options.sleep_level != 2)
    if options.sleep_level is not None:
        engine.sleep(level=options.sleep_level, mode="abort")
    elif options.paused:
        engine.pause("keep")


PR_SET_NAME = 15
COMM_MAX = 15  # /proc/<pid>/comm holds 15 characters


def process_title(config: StageConfig) -> str:
    """``omnistage-stage<id>-<display name>``: what ``ps`` shows for the stage's process
    (``omnistage-stage<id>.<replica>-<display name>`` for a replica of a replicated stage)."""
    return f"omnistage-stage{_stage_label(config)}-{config.display_name}"


def _stage_label(config: StageConfig) -> str:
    if config.replicas > 1:
        return f"{config.stage_id}.{config.replica_id}"
    return str(config.stage_id)


def short_name(config: StageConfig) -> str:
    """The 15-character process name (``comm``: ``top``, ``ps -e``): ``stage0-thinker``."""
    return f"stage{_stage_label(config)}-{config.display_name}"[:COMM_MAX]


def set_process_title(title: str, short: str | None = None) -> None:
    """Show ``title`` as the process's command line (with the ``setproctitle`` package, when
    installed) and ``short`` (default: ``title``, cut to 15 characters) as its name."""
    try:
        import setproctitle
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(title)
    # setproctitle sets the name too, to the first 15 characters of the title: the short
    # name (on Linux; elsewhere nothing happens) reads better.
    name = (short or title)[:COMM_MAX].encode(errors="replace")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGKILL to this process when the parent dies, so a crashed
    # API server never leaves stage processes behind.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stage_main(
    config_json: str, in_addr: str, out_addr: str, num_threads: int, startup_json: str = "{}"
) -> None:
    """Entry point of a stage process."""
    global IS_STAGE_PROCESS
    IS_STAGE_PROCESS = True
    _die_with_parent()
    # Ctrl-C goes to the whole process group; the parent owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    serve_stage(
        config_json, in_addr, out_addr, num_threads, startup_json,
        should_stop=lambda: os.getppid() != parent,
    )  # fmt: skip


def serve_stage(
    config_json: str,
    in_addr: str,
    out_addr: str,
    num_threads: int,
    startup_json: str,
    should_stop: Callable[[], bool],
    host: str = "127.0.0.1",
) -> None:
    """Build the stage, announce it on ``out_addr`` and serve ``in_addr`` until told to shut
    down or ``should_stop()`` (a stage process's, or a Ray actor's; see ``engine/ray``).
    ``host``: the address other stages reach this one's hand-offs at (``socket``)."""
    configure_from_env()
    config = StageConfig.model_validate_json(config_json)
    set_process_title(process_title(config), short_name(config))
    options = decode_startup(startup_json)
    import torch

    torch.set_num_threads(num_threads)
    channel = ZmqChannel(in_addr, out_addr)
    stop_heartbeat = channel.start_heartbeat(config.stage_id, options.heartbeat_interval_s)
    try:
        try:
            engine = build_engine(config, options)
        except Exception as exc:
            channel.send(
                StartupFailed(
                    stage_id=config.stage_id,
                    error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}",
                )
            )
            return
        channel.send(
            Ready(stage_id=config.stage_id, kind=config.kind, pid=os.getpid(), info=engine.info())
        )
        from omnistage.stage.core import StageCore
        from omnistage.stage.handoff import make_transport

        transport = make_transport(options.handoff, host)
        core = StageCore(engine, drain_timeout_s=config.drain_timeout_s, transport=transport)
        core.serve(channel, should_stop=should_stop)
        engine.shutdown()
    finally:
        stop_heartbeat.set()
        channel.close()
