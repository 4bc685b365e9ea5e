"""Stages as Ray actors: placed by Ray (a stage's ``placement``), reached over ZMQ TCP.

``RayLauncher`` joins a Ray cluster — ``RAY_ADDRESS``, else a running one
(``ray.init(address="auto")``), else a local one it starts — and launches each stage as a
``StageActor`` in a placement group of its own: one bundle per tensor-parallel rank, packed
on one node (``STRICT_PACK``), each asking for the stage's ``placement`` resources. The front
end binds a PUSH and a PULL socket on its node's address and hands the addresses to the
actor, which serves the stage exactly as a stage process does (``proc.serve_stage``): the same
messages, heartbeats, ACKs, so admission, the control plane, supervision and metrics are the
ones of local processes. A rank-0 actor starts its other ranks as processes on its node.

Replicas (``replicas: N``) are launched one by one, each in a placement group of its own: with
``replica_placements`` each asks for its own; without, each asks for the stage's ``placement``
and replica i's group is steered to a node (``spread_node``) — node i mod k of the k live nodes
whose resources could hold the group, in node-id order — softly: when that node has no room at
the moment, Ray places the group on another, so a one-node cluster holds them all.

Ray is an optional dependency (``pip install 'omnistage[ray]'``): only this module imports it,
and only when a pipeline asks for Ray.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from omnistage.config import StageConfig
from omnistage.engine.launcher import OnExit, ProcessStageHandle
from omnistage.engine.spawn import SpawnedStage
from omnistage.errors import StageStartupError
from omnistage.stage.ar.ray_ranks import ActorRank
from omnistage.stage.handoff import SOCKET
from omnistage.stage.startup import StartupOptions, encode_startup


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise StageStartupError(
            "this pipeline runs on Ray (a stage has 'placement' or 'replica_placements', or "
            "--distributed-executor-backend ray) but ray is not installed: "
            "pip install 'omnistage[ray]'"
        ) from exc
    return ray


def ensure_ray() -> Any:
    """Ray, initialised: ``RAY_ADDRESS``, else a running cluster, else a local one."""
    ray = import_ray()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:
                ray.init(log_to_driver=False)
    return ray


class StageActor:
    """A stage (rank 0 of it) in a Ray worker process; ``run`` serves until shutdown."""

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def pid(self) -> int:
        return os.getpid()

    def run(
        self, config_json: str, in_addr: str, out_addr: str, num_threads: int, startup: str
    ) -> None:
        import ray

        from omnistage.stage import proc

        proc.IS_STAGE_PROCESS = True  # a dead tensor-parallel rank ends this actor
        proc.serve_stage(
            config_json, in_addr, out_addr, num_threads, startup,
            should_stop=self._stopped.is_set, host=ray.util.get_node_ip_address(),
        )  # fmt: skip

    def stop(self) -> None:
        self._stopped.set()


class ActorProcess(ActorRank):
    """A stage actor behind the part of ``multiprocessing.Process`` the handle uses; killing
    it gives its placement group back too."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any, group: Any, name: str) -> None:
        super().__init__(ray, actor, run_ref, name)
        self._group = group
        self._node_id: str | None = None
        self._killed = False

    @property
    def node_id(self) -> str:
        if self._node_id is None:
            self._node_id = self._ray.get(self.actor.node_id.remote(), timeout=60)
        return self._node_id

    def kill(self) -> None:
        """End the actor and give its placement group back (once)."""
        if self._killed:
            return
        self._killed = True
        super().kill()
        with contextlib.suppress(Exception):  # already gone with its node
            self._ray.util.remove_placement_group(self._group)


class RayStageHandle(ProcessStageHandle):
    """A stage actor, spoken to like a stage process (over TCP instead of ipc://)."""

    @property
    def node_id(self) -> str:
        """The Ray node the stage runs on."""
        return self.actor_process.node_id

    @property
    def actor_process(self) -> ActorProcess:
        process = self.process
        assert isinstance(process, ActorProcess)
        return process

    def _watch(self, on_exit: OnExit) -> None:
        process = self.actor_process
        while not self._closing:
            if not process.is_alive():
                if not self._closing:
                    on_exit(f"actor {process.name} ended (exit code {process.exitcode})")
                return
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self.heartbeat_timeout_s and not self._closing:
                process.kill()
                on_exit(f"actor {process.name} sent no heartbeat for {silent_s:.0f}s (killed)")
                return
            time.sleep(0.2)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        super().shutdown(timeout_s)
        # A stage that served to its end leaves an idle actor and its placement group.
        self.actor_process.kill()
        # No thread of this handle may still be asking Ray when the caller shuts Ray down.
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5.0)


def spread_node(
    nodes: list[dict[str, Any]], config: StageConfig, bundle: dict[str, float]
) -> str | None:
    """The node a replica's placement group is steered to (softly) when its stage runs several
    replicas with no ``replica_placements``: of the live ``nodes`` (``ray.nodes()``) whose
    resources could hold the stage's ``tensor_parallel_size`` bundles, in node-id order, the
    one at ``replica_id`` modulo their number (None: one replica, placements given, or no such
    node, where Ray alone chooses)."""
    if config.replicas == 1 or config.replica_placements is not None:
        return None
    need = {key: value * config.tensor_parallel_size for key, value in bundle.items() if value}
    fit = sorted(
        str(node["NodeID"])
        for node in nodes
        if node.get("Alive")
        and all(node.get("Resources", {}).get(key, 0) >= value for key, value in need.items())
    )
    return fit[config.replica_id % len(fit)] if fit else None


def stage_bundle(config: StageConfig) -> dict[str, float]:
    """What each rank of the stage (of the replica) asks Ray for: its ``placement``."""
    placement = config.placement
    gpus = placement.num_gpus if placement else 0.0
    return {
        "CPU": placement.num_cpus if placement else 1.0,
        **({"GPU": gpus} if gpus else {}),
        **(placement.resources if placement else {}),
    }


SPREAD_SETTLE_S = 2.0  # how long a replica's group asks again for its node (see below)


def placement_group_for(ray: Any, config: StageConfig, ready_timeout_s: float) -> Any:
    """The stage's (replica's) placement group, ready: one ``stage_bundle`` per rank, packed on
    one node (``STRICT_PACK``), steered to ``spread_node``'s node for a replica to spread.

    A replica that comes back after a death asks for the node it had; Ray releases the group
    of its last life asynchronously (~0.1 s), and a soft target without room at that moment
    lands elsewhere: a group placed off its target is given back and asked for again, for up
    to ``SPREAD_SETTLE_S``, then taken wherever Ray put it."""
    from ray.util.placement_group import placement_group, placement_group_table

    bundle = stage_bundle(config)
    bundles = [bundle] * config.tensor_parallel_size
    target = spread_node(ray.nodes(), config, bundle)
    hint = {} if target is None else {"_soft_target_node_id": target}
    settle_by = time.monotonic() + SPREAD_SETTLE_S
    while True:
        group = placement_group(bundles, strategy="STRICT_PACK", **hint)
        try:
            ray.get(group.ready(), timeout=ready_timeout_s)
        except Exception as exc:
            ray.util.remove_placement_group(group)
            which = f"stage {config.stage_id}"
            if config.replicas > 1:
                which += f" replica {config.replica_id}"
            raise StageStartupError(
                f"{which}: no Ray node offers {bundle} x "
                f"{config.tensor_parallel_size} (placement) within {ready_timeout_s:g}s"
            ) from exc
        if target is None or time.monotonic() >= settle_by:
            return group
        if placement_group_table(group)["bundles_to_node_id"].get(0) == target:
            return group
        ray.util.remove_placement_group(group)
        time.sleep(0.1)


def spawn_actor(
    config: StageConfig, options: StartupOptions, num_threads: int, ready_timeout_s: float
) -> SpawnedStage:
    """Bind the front end's sockets on this node's address and start the stage's actor."""
    ray = ensure_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from omnistage.stage.proc import process_title

    placement = config.placement
    resources = dict(placement.resources) if placement else {}
    cpus = placement.num_cpus if placement else 1.0
    gpus = placement.num_gpus if placement else 0.0
    group = placement_group_for(ray, config, ready_timeout_s)
    host = ray.util.get_node_ip_address()
    ctx: zmq.Context[Any] = zmq.Context()
    to_stage, from_stage = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (to_stage, from_stage):
        sock.setsockopt(zmq.LINGER, 0)
    to_stage.setsockopt(zmq.SNDHWM, 0)
    in_port = to_stage.bind_to_random_port(f"tcp://{host}")
    out_port = from_stage.bind_to_random_port(f"tcp://{host}")
    name = process_title(config)  # omnistage-stage<id>[.<replica>]-<name>
    actor = (
        ray.remote(StageActor)
        .options(
            num_cpus=cpus,
            num_gpus=gpus,
            resources=resources,
            max_concurrency=4,  # run() serves while node_id()/pid()/stop() answer
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0
            ),
        )
        .remote()
    )
    run = actor.run.remote(
        config.model_dump_json(),
        f"tcp://{host}:{in_port}",
        f"tcp://{host}:{out_port}",
        num_threads,
        encode_startup(options),
    )
    process = ActorProcess(ray, actor, run, group, name)
    # The handle removes its (empty) folder like a local stage's ipc:// folder.
    return SpawnedStage(config.stage_id, process, ctx, to_stage, from_stage, tempfile.mkdtemp())  # type: ignore[arg-type]


class RayLauncher:
    """Each stage a Ray actor in a placement group of its own."""

    def __init__(
        self,
        num_threads: Callable[[StageConfig], int],
        ready_timeout_s: float = 600.0,
        heartbeat_timeout_s: float = 60.0,
    ) -> None:
        ensure_ray()
        self.num_threads = num_threads
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s

    def launch(self, config: StageConfig, options: StartupOptions) -> RayStageHandle:
        # Stages may sit on different nodes: each hands its output over from a socket.
        options = msgspec.structs.replace(options, handoff=SOCKET)
        threads = self.num_threads(config)
        spawned = spawn_actor(config, options, threads, self.ready_timeout_s)
        return RayStageHandle(
            config,
            options,
            num_threads=threads,
            ready_timeout_s=self.ready_timeout_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            spawned=spawned,
        )
