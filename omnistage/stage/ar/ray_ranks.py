"""Ranks 1..N-1 of a tensor-parallel stage as Ray actors, when rank 0 is a Ray actor itself.

A stage placed by Ray gets a placement group with one bundle per rank on one node
(``engine/ray_launcher.py``); rank 0 is the actor in bundle 0 and starts each other rank as an
actor in its own bundle, so Ray gives each rank its own share — its GPU, seen as ``cuda:0``.
Ray is imported only in a process that is already a Ray worker (``current_placement``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from omnistage.config import Placement


class RankActor:
    """One rank in a Ray worker process; ``run`` serves until rank 0 says shut down."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, *args: Any) -> None:
        from omnistage.stage.ar.rank_main import follower_entry

        follower_entry(*args)


def current_placement() -> tuple[Any, Any] | None:
    """``(ray, placement group)`` when this process is a Ray actor in a placement group."""
    if "ray" not in sys.modules:  # never the first to import it
        return None
    import ray

    if not ray.is_initialized():
        return None
    group = ray.util.get_current_placement_group()
    return (ray, group) if group is not None else None


class ActorRank:
    """A Ray actor serving in ``run`` behind the part of ``multiprocessing.Process`` its
    owner uses (``RankGroup`` here; the engine's stage handles too)."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any, name: str) -> None:
        self._ray, self.actor, self._run, self.name = ray, actor, run_ref, name
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        if self._pid is None:
            with contextlib.suppress(Exception):  # a dead actor has no pid to tell
                self._pid = self._ray.get(self.actor.pid.remote(), timeout=60)
        return self._pid

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self._run], timeout=0)
        return not done

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        try:
            self._ray.get(self._run, timeout=0)
        except Exception:  # noqa: BLE001 - the actor died or its run raised
            return 1
        return 0

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._run], timeout=timeout)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor, no_restart=True)


def start_rank_actor(
    ray: Any, group: Any, rank: int, placement: Placement | None, name: str, args: tuple
) -> ActorRank:
    """Start rank ``rank`` as an actor in bundle ``rank`` of the stage's placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = (
        ray.remote(RankActor)
        .options(
            num_cpus=placement.num_cpus if placement else 1,
            num_gpus=placement.num_gpus if placement else 0,
            resources=dict(placement.resources) if placement else {},
            max_concurrency=2,  # run() serves while pid() answers
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            ),
        )
        .remote()
    )
    return ActorRank(ray, actor, actor.run.remote(*args), name)
