"""Spawning stage processes, importing no torch: the first half of a local launch.

``omnistage serve`` spawns its stages as soon as it knows its pipeline (``prestart``), then
imports the rest of itself (torch, the engine client, the HTTP app) while the stages import
theirs — on different cores. ``ProcessStageHandle`` (``launcher.py``) takes a ``SpawnedStage``
over and speaks the stage protocol on its sockets.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq

from omnistage.config import PipelineConfig, StageConfig
from omnistage.stage.startup import (
    StartupOptions,
    encode_startup,
    start_without_main,
    stop_process,
)


def uses_ray(pipeline: PipelineConfig, backend: str = "mp") -> bool:
    """Whether the pipeline's stages start as Ray actors: the backend says so, or a stage
    has a ``placement`` (or ``replica_placements``)."""
    if backend not in ("mp", "ray"):
        raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
    return backend == "ray" or any(
        s.placement is not None or s.replica_placements is not None for s in pipeline.stages
    )


def stage_threads(stage: StageConfig, num_stages: int) -> int:
    """A stage's torch threads: its ``torch_threads``, else an equal share of the cores
    among ``num_stages`` stage processes (every replica counts)."""
    return stage.torch_threads or max(1, (os.cpu_count() or 1) // num_stages)


@dataclass
class SpawnedStage:
    """A stage process just started, and the two bound sockets it connects to."""

    stage_id: int
    process: multiprocessing.process.BaseProcess
    ctx: zmq.Context[Any]
    to_stage: zmq.Socket[Any]
    from_stage: zmq.Socket[Any]
    ipc_dir: str

    def discard(self) -> None:
        """Stop a spawned stage nobody took over, and release its sockets."""
        stop_process(self.process, 0)
        self.to_stage.close(linger=0)
        self.from_stage.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def spawn_stage(config: StageConfig, options: StartupOptions, num_threads: int) -> SpawnedStage:
    """Bind a stage's ipc:// sockets and start its process (it connects and announces itself)."""
    from omnistage.stage.entry import stage_entry

    ipc_dir = tempfile.mkdtemp(prefix=f"omnistage-stage{config.stage_id}-")
    in_addr, out_addr = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    ctx: zmq.Context[Any] = zmq.Context()
    to_stage = ctx.socket(zmq.PUSH)
    to_stage.setsockopt(zmq.LINGER, 0)
    # No high-water mark: sends never block the event loop on a busy stage, and a send that
    # would block can only mean the stage is gone (``ProcessStageHandle.send``).
    to_stage.setsockopt(zmq.SNDHWM, 0)
    to_stage.bind(in_addr)
    from_stage = ctx.socket(zmq.PULL)
    from_stage.setsockopt(zmq.LINGER, 0)
    from_stage.bind(out_addr)
    process = multiprocessing.get_context("spawn").Process(
        target=stage_entry,
        args=(config.model_dump_json(), in_addr, out_addr, num_threads, encode_startup(options)),
        name=f"omnistage-stage{config.stage_id}-{config.display_name}",
        daemon=True,
    )
    spawned = SpawnedStage(config.stage_id, process, ctx, to_stage, from_stage, ipc_dir)
    try:
        start_without_main(process)
    except BaseException:
        spawned.discard()
        raise
    return spawned


def prestart(pipeline: PipelineConfig) -> dict[int, SpawnedStage]:
    """Spawn every stage of ``pipeline`` (fresh, awake) now; a ``LocalProcessLauncher`` given
    the result takes them over instead of spawning them again."""
    spawned: dict[int, SpawnedStage] = {}
    num_processes = sum(stage.replicas for stage in pipeline.stages)
    try:
        for stage in pipeline.stages:  # a replicated stage's first replica (the others: later)
            threads = stage_threads(stage, num_processes)
            spawned[stage.stage_id] = spawn_stage(
                stage.replica_config(0), StartupOptions(), threads
            )
    except BaseException:
        for stage_process in spawned.values():
            stage_process.discard()
        raise
    return spawned
