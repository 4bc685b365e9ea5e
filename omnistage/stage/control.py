"""Control operations, one struct each, and the ACK they are answered with.

The same structs cross the stage channel (engine client → stage process, inside a
``ControlCall``) and the tensor-parallel rank channel (rank 0 → ranks 1..N-1); each side
dispatches them by type (``StageCore``, ``rank_main``), never by a method name. Values are
checked when a struct is made — by the engine client before it touches any stage, and again
when a stage decodes one — with the vocabulary's one check per value
(``omnistage.stage.vocabulary``).

An operation that changes memory or weights is answered with ACKs shaped like vLLM-Omni's
``OmniACK``: one per rank, rank 0's first (its status is the whole stage's). Everything else
answers a plain value.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import msgspec

from omnistage.errors import InvalidRequestError
from omnistage.rl.bounds import check_weight_version
from omnistage.stage.vocabulary import (
    DEFAULT_SLEEP_LEVEL,
    DEFAULT_SLEEP_MODE,
    check_level,
    check_mode,
    check_tags,
)

SYNC_PREFIX = "sync:"  # how weights a trainer pushed show in ``weight_sources``


class AckMetadata(msgspec.Struct):
    """What an operation did, measured (vLLM-Omni's ``OmniACK.metadata`` plus omnistage's)."""

    level: int | None = None
    mode: str | None = None
    tags: list[str] = []
    latency_ms: float = 0.0
    cuda_graph_recalled: bool = False
    host_backup_bytes: int = 0
    restored_bytes: int = 0
    # Achieved GB/s: a wake's restored_bytes over its latency_ms; a level-1 sleep's bytes
    # offloaded over the arena's time for them. 0.0 where nothing was moved.
    gbps: float = 0.0
    reload_gbps: float = 0.0  # a wake that reloaded discarded weights: bytes read / reload time
    resident_bytes_before: int = 0
    resident_bytes_after: int = 0
    aborted: int = 0
    preempted: int = 0
    sleeping_tags: list[str] = []
    weights_valid: bool = True
    # After a wake: whether the stage still waits for a resume (an AR stage does; a stage
    # kind that schedules again by itself does not).
    paused: bool = False
    weight_sources: list[str] | None = None  # after a weight update: what a reload replays
    weight_version: str | None = None  # after a weight sync: the trainer's version


class Ack(msgspec.Struct):
    """One rank's answer to a sleep, wake or weight update, shaped like vLLM-Omni's
    ``OmniACK``. Inside a stage, rank 0's ACK carries the other ranks' in ``rank_acks`` (and
    its status is the stage's); ``flat()`` is what leaves the stage: one ACK per rank."""

    task_id: str
    status: str  # SUCCESS | ERROR | SKIPPED
    stage_id: int
    rank: int = 0
    freed_bytes: int = 0
    replica_id: int | None = None  # which of the stage's replicas answered (None: it has one)
    error_msg: str | None = None
    metadata: AckMetadata = msgspec.field(default_factory=AckMetadata)
    rank_acks: list[Ack] = []

    def flat(self) -> list[Ack]:
        """This rank's ACK (without ``rank_acks``) and the other ranks', in rank order."""
        own = msgspec.structs.replace(self, rank_acks=[])
        return [own, *(a for rank in self.rank_acks for a in rank.flat())]

    def to_dict(self) -> dict[str, Any]:
        data = dict(msgspec.to_builtins(self))
        data.pop("rank_acks", None)
        if data.get("replica_id") is None:
            data.pop("replica_id", None)
        return data


def acks_of(ack: Ack) -> list[dict[str, Any]]:
    """A stage's ACK as the Python API and HTTP answer it: one dict per rank."""
    return [a.to_dict() for a in ack.flat()]


_task_ids = itertools.count(1)


def make_ack(
    stage_id: int,
    *,
    status: str = "SUCCESS",
    rank: int = 0,
    freed_bytes: int = 0,
    error_msg: str | None = None,
    **metadata: Any,
) -> Ack:
    """An ACK shaped like vLLM-Omni's ``OmniACK`` with omnistage's metadata."""
    return Ack(
        task_id=f"omni-{stage_id}-{os.getpid()}-{next(_task_ids)}",
        status=status,
        stage_id=stage_id,
        rank=rank,
        freed_bytes=max(0, int(freed_bytes)),
        error_msg=error_msg,
        metadata=AckMetadata(**metadata),
    )


# -- the operations ------------------------------------------------------------------------


class _Op(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class Sleep(_Op):
    """Pause with ``mode`` (unless paused) and release memory for ``level`` (0: pause only).
    ``drain_timeout_s`` bounds a ``wait`` drain (default: the stage's ``drain_timeout_s``)."""

    level: int = DEFAULT_SLEEP_LEVEL
    mode: str = DEFAULT_SLEEP_MODE
    tags: list[str] | None = None
    drain_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_level(self.level)
        check_mode(self.mode)
        check_tags(self.tags)
        if self.drain_timeout_s is not None and not self.drain_timeout_s > 0:
            raise InvalidRequestError("drain_timeout_s", "must be a positive number of seconds")


class WakeUp(_Op):
    """Map memory back; discarded weights are reloaded unless ``reload`` is False. With
    ``resume`` a stage that is wholly awake again schedules at once (one call instead of a
    wake and a resume)."""

    tags: list[str] | None = None
    reload: bool = True
    resume: bool = False

    def __post_init__(self) -> None:
        check_tags(self.tags)


class Pause(_Op):
    mode: str = DEFAULT_SLEEP_MODE

    def __post_init__(self) -> None:
        check_mode(self.mode)


class Resume(_Op):
    pass


class UpdateWeights(_Op):
    """Load a safetensors file or folder into the weights in place (checked first)."""

    path: str
    check_finite: bool = True


class AdoptHistory(_Op):
    """Take over the weight history of a previous process of the stage (a restart)."""

    sources: list[str]
    load: bool = True


class Status(_Op):
    pass


class IsSleeping(_Op):
    pass


class ResetPrefixCache(_Op):
    pass


class InitWeightTransfer(_Op):
    """Join a trainer; ``abort_open`` discards an open update session (else a conflict)."""

    backend: str = "nccl"
    init_info: dict[str, Any] = {}
    abort_open: bool = False


class StartWeightUpdate(_Op):
    """Open an update session (answers its id). ``require_session``: update and finish must
    name it; ``abort_open``: discard another open session instead of a conflict."""

    update_info: dict[str, Any] | None = None
    require_session: bool = False
    abort_open: bool = False


class ReceiveWeights(_Op):
    """One chunk of the session ``session`` (None: the open one, if it allows that)."""

    update_info: dict[str, Any]
    session: str | None = None


class FinishWeightUpdate(_Op):
    """Apply the session's update as ``weight_version`` (bounded: it shows in every reply)."""

    weight_version: str | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if self.weight_version is not None:
            check_weight_version(self.weight_version)


class AbortWeightUpdate(_Op):
    """End the session ``session`` without applying it (its owner giving up)."""

    session: str | None = None


class WeightsChecksum(_Op):
    pass


ControlOp = (
    Sleep
    | WakeUp
    | Pause
    | Resume
    | UpdateWeights
    | AdoptHistory
    | Status
    | IsSleeping
    | ResetPrefixCache
    | InitWeightTransfer
    | StartWeightUpdate
    | ReceiveWeights
    | FinishWeightUpdate
    | AbortWeightUpdate
    | WeightsChecksum
)
# The operations answered with ACKs (the others answer a plain value).
ACKED = (Sleep, WakeUp, UpdateWeights, FinishWeightUpdate)
