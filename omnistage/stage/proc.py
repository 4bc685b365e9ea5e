"""The stage process: one OS process per stage, owning its device, arena and engine.

Started with multiprocessing ``spawn`` by the engine client. It connects two ZMQ sockets
(requests and utility calls in, outputs and replies out), builds its engine — importing only
what its kind needs — announces itself with ``Ready`` (or ``StartupFailed``) and runs the
``StageCore`` loop until told to shut down or its parent goes away.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback
from typing import Any

import zmq

from omnistage.config import StageConfig
from omnistage.stage.messages import (
    FromStage,
    Ready,
    StartupFailed,
    ToStage,
    decode_to_stage,
    encode,
)

logger = logging.getLogger(__name__)


class ZmqChannel:
    def __init__(self, in_addr: str, out_addr: str) -> None:
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.connect(in_addr)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.connect(out_addr)

    def recv(self, timeout_s: float) -> ToStage | None:
        if not self._in.poll(int(timeout_s * 1000)):
            return None
        return decode_to_stage(self._in.recv())

    def send(self, msg: FromStage) -> None:
        self._out.send(encode(msg))

    def close(self) -> None:
        self._in.close(linger=0)
        self._out.close()
        self._ctx.term()


def build_engine(config: StageConfig) -> tuple[Any, Any]:
    """The engine for ``config.kind`` and the function turning wire requests into its requests."""
    from omnistage.stage.requests import request_builder

    if config.kind == "ar":
        from omnistage.stage.ar.engine import ARStageEngine

        engine: Any = ARStageEngine(config)
    else:
        from omnistage.stage.diffusion.engine import DiffusionStageEngine

        engine = DiffusionStageEngine(config)
    return engine, request_builder(config.kind, engine)


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGKILL to this process when the parent dies, so a crashed
    # API server never leaves stage processes behind.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stage_main(config_json: str, in_addr: str, out_addr: str, num_threads: int) -> None:
    """Entry point of a stage process."""
    _die_with_parent()
    # Ctrl-C goes to the whole process group; the parent owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    config = StageConfig.model_validate_json(config_json)
    import torch

    torch.set_num_threads(num_threads)
    channel = ZmqChannel(in_addr, out_addr)
    try:
        try:
            engine, build_request = build_engine(config)
        except Exception as exc:
            channel.send(
                StartupFailed(
                    stage_id=config.stage_id,
                    error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}",
                )
            )
            return
        channel.send(
            Ready(stage_id=config.stage_id, kind=config.kind, pid=os.getpid(), info=engine.status())
        )
        from omnistage.stage.core import StageCore

        core = StageCore(engine, build_request, drain_timeout_s=config.drain_timeout_s)
        core.serve(channel, should_stop=lambda: os.getppid() != parent)
        engine.shutdown()
    finally:
        channel.close()
