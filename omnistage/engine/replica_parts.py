"""The parts of stage replicas that need no replica (``replicas.py`` holds the client): the
replicas' states, where prompts' prefixes were served (``PrefixPlacement``), a stage's ACKs
and status from its replicas' (``rolled_up``, ``summarized``), and the start-time check of
a pipeline's replica settings (``check_replicas``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from omnistage.stage.control import Ack, make_ack

AWAKE, ASLEEP, DRAINING, DEAD = "awake", "asleep", "draining", "dead"


ReplicaDeath = Callable[[int, int], bool]


class PrefixPlacement:
    """Where prompts' prefixes were last served: keys are hashes of a prompt's first
    ``block * 2**k`` token ids (k = 0, 1, ...), so prompts sharing a long head share the keys
    up to its length; the longest known key names the replica. Bounded (``max_keys``, least
    recently used dropped)."""

    def __init__(self, block: int = 16, max_keys: int = 65536) -> None:
        self.block = block
        self.max_keys = max_keys
        self._where: OrderedDict[bytes, int] = OrderedDict()

    def _keys(self, token_ids: Sequence[int]) -> list[bytes]:
        keys, digest, done, length = [], hashlib.blake2b(digest_size=16), 0, self.block
        while length <= len(token_ids):
            digest.update(msgspec.msgpack.encode(list(token_ids[done:length])))
            keys.append(digest.copy().digest())
            done, length = length, length * 2
        return keys

    def lookup(self, token_ids: Sequence[int]) -> int | None:
        for key in reversed(self._keys(token_ids)):
            replica = self._where.get(key)
            if replica is not None:
                self._where.move_to_end(key)
                return replica
        return None

    def record(self, token_ids: Sequence[int], replica: int) -> None:
        for key in self._keys(token_ids):
            self._where[key] = replica
            self._where.move_to_end(key)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica whose cache is gone (slept, restarted): none of its prefixes holds."""
        for key in [k for k, r in self._where.items() if r == replica]:
            del self._where[key]


_BYTES = ("reserved_bytes", "resident_bytes", "released_bytes", "backup_bytes")
_REPLICA_ONLY = ("replica_id", "state", "level", "pid", "in_flight", "restarting")


def summarized(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage's status from its replicas': queues and memory summed (per tag too), what
    is asleep or invalid only what is so on every replica (the stage serves while one
    serves), the rest as the first replica has it."""
    summary = {k: v for k, v in each[0].items() if k not in _REPLICA_ONLY}
    for key in ("num_running", "num_waiting"):
        values = [e[key] for e in each if isinstance(e.get(key), int)]
        if values:
            summary[key] = sum(values)
    for key in ("is_sleeping", "weights_valid"):
        values = [e[key] for e in each if isinstance(e.get(key), bool)]
        if values:
            summary[key] = all(values) if key == "is_sleeping" else any(values)
    tag_lists = [e["sleeping_tags"] for e in each if isinstance(e.get("sleeping_tags"), list)]
    if tag_lists:
        summary["sleeping_tags"] = [t for t in tag_lists[0] if all(t in ts for ts in tag_lists)]
    memories = [e["memory"] for e in each if isinstance(e.get("memory"), dict)]
    if memories:
        memory = {**memories[0], **{k: sum(int(m.get(k, 0)) for m in memories) for k in _BYTES}}
        tags: dict[str, dict[str, Any]] = {}
        for m in memories:
            for tag, stats in (m.get("tags") or {}).items():
                into = tags.setdefault(tag, {**stats, **dict.fromkeys(_BYTES, 0)})
                for k in _BYTES:
                    into[k] += int(stats.get(k, 0))
                into["is_asleep"] = into.get("is_asleep", True) and bool(stats.get("is_asleep"))
        memory["tags"] = tags
        summary["memory"] = memory
    return summary


def replica_acks(stage_id: int, replica_id: int, result: Any) -> list[Ack]:
    """A replica's ACKs (or one ``ERROR`` ACK for the exception its call raised), each
    stamped with its ``replica_id``."""
    if not (isinstance(result, list) and result and all(isinstance(a, Ack) for a in result)):
        error = f"{type(result).__name__}: {result}"
        result = [make_ack(stage_id, status="ERROR", error_msg=error)]
    return [msgspec.structs.replace(a, replica_id=replica_id) for a in result]


def rolled_up(acks: list[Ack]) -> list[Ack]:
    """``acks`` with one whose status is the stage's first: the first ``ERROR``, else the
    first ``SUCCESS``, else the first (each replica's rank 0 speaks for its ranks)."""
    heads = [a for a in acks if a.rank == 0]
    for status in ("ERROR", "SUCCESS"):
        lead = next((a for a in heads if a.status == status), None)
        if lead is not None:
            return [lead, *(a for a in acks if a is not lead)]
    return acks


@contextlib.asynccontextmanager
async def replicas_together(gate: Any, pipeline: Any, stage_id: int) -> AsyncIterator[None]:
    """Around a weight update of a replicated stage: its admission closed, so no request enters
    until every replica has the new weights (those running finish on theirs, as on a stage of
    one process); reopened after, unless it was paused before. A stage of one: nothing."""
    if pipeline.stages[stage_id].replicas == 1:
        yield
        return
    was_paused = gate.stages[stage_id].paused
    await gate.close_and_drain_admission([stage_id])
    try:
        yield
    finally:
        if not was_paused:
            await gate.reopen([stage_id])


def check_replica_ids(pipeline: Any, stage_ids: list[int], replica_ids: Sequence[int]) -> None:
    """Each replica id names a replica of every stage addressed (400 naming
    ``replica_ids``)."""
    from omnistage.errors import InvalidRequestError

    if not replica_ids:
        raise InvalidRequestError("replica_ids", "must name at least one replica")
    for sid in stage_ids:
        count = pipeline.stages[sid].replicas
        bad = [r for r in replica_ids if not 0 <= r < count]
        if bad:
            raise InvalidRequestError(
                "replica_ids", f"stage {sid} has replicas 0 to {count - 1}; {bad} is not one"
            )


def serves_beside(client: Any, replica_ids: Sequence[int]) -> bool:
    """Whether a replica of the stage outside ``replica_ids`` takes requests: then a sleep of
    those is the replicas' own, the stage serving on."""
    serving = getattr(client, "serving", None)
    return serving is not None and bool(set(serving()) - set(replica_ids))


def check_replicas(
    pipeline: Any,
    *,
    on_cpu_cores: int | None = None,
    cuda_devices: int | None = None,
    on_ray: bool = False,
) -> None:
    """Each stage's replicas fit what it is given (``ConfigError`` naming the key): on the
    CPU, ``replicas`` x ``tensor_parallel_size`` x ``torch_threads`` (when set) within the
    machine's cores; on CUDA, ``replicas`` x ``tensor_parallel_size`` devices from the
    stage's first, within the devices there are (when CUDA is there to count them). On Ray
    (``on_ray``) the replicas go where their placements find room: Ray refuses what fits
    nowhere, and this machine's cores and devices say nothing."""
    from omnistage.config import ConfigError

    if on_ray:
        return
    on_cpu_cores = on_cpu_cores if on_cpu_cores is not None else os.cpu_count() or 1
    cuda_devices = cuda_devices if cuda_devices is not None else _cuda_devices()
    for stage in pipeline.stages:
        key = f"stages.{stage.stage_id}.replicas"
        ranks = stage.replicas * stage.tensor_parallel_size
        if stage.replicas == 1:
            continue
        if not stage.device.startswith("cuda"):
            if stage.torch_threads and ranks * stage.torch_threads > on_cpu_cores:
                raise ConfigError(
                    f"{key}: {stage.replicas} replicas x {stage.tensor_parallel_size} ranks x "
                    f"{stage.torch_threads} torch_threads is more than the {on_cpu_cores} "
                    "cores here"
                )
            continue
        if stage.replica_devices is not None or not cuda_devices:
            continue
        base = int(stage.device.partition(":")[2] or 0)
        if base + ranks > cuda_devices:
            raise ConfigError(
                f"{key}: {stage.replicas} replicas x {stage.tensor_parallel_size} ranks from "
                f"{stage.device} need devices up to cuda:{base + ranks - 1}; there are "
                f"{cuda_devices} (or name them: replica_devices)"
            )


def _cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA; torch is not imported for it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())
