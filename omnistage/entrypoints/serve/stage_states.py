"""Which stages sleep, as the control routes see it: read from the engine client, never kept
beside it.

An engine client that reports its own truth (``AsyncOmni``: ``sleeping_stage_ids()``, which
covers failed sleeps, automatic wakes, restarts and dead stages) is only read. An engine
client that does not (vLLM-Omni's interface: ``sleep`` and ``wake_up`` only) gets what
vLLM-Omni's own server keeps for it: a record of the stages its ACKs put to sleep, written here
and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from omnistage.stage.vocabulary import MEMORY_TAGS


class StageStates(Protocol):
    def sleeping_stage_ids(self) -> set[int]: ...
    def record_sleep(self, stage_ids: Sequence[int], acks: Sequence[Mapping[str, Any]]) -> None: ...
    def record_wake(
        self,
        stage_ids: Sequence[int],
        acks: Sequence[Mapping[str, Any]],
        tags: Sequence[str] | None,
    ) -> None: ...


class EngineStates:
    """The engine client's own truth; nothing to record."""

    def __init__(self, engine_client: Any) -> None:
        self.engine_client = engine_client

    def sleeping_stage_ids(self) -> set[int]:
        return set(self.engine_client.sleeping_stage_ids())

    def record_sleep(self, stage_ids: Sequence[int], acks: Sequence[Mapping[str, Any]]) -> None:
        pass

    def record_wake(
        self,
        stage_ids: Sequence[int],
        acks: Sequence[Mapping[str, Any]],
        tags: Sequence[str] | None,
    ) -> None:
        pass


def failed_stage_ids(acks: Iterable[Mapping[str, Any]]) -> set[int]:
    """Stages with an ERROR ACK (any rank): their state did not change."""
    return {
        ack["stage_id"]
        for ack in acks
        if ack.get("status") == "ERROR" and isinstance(ack.get("stage_id"), int)
    }


class RecordedStates:
    """For an engine client without a truth of its own: the stages its ACKs put to sleep."""

    def __init__(self, sleeping: Iterable[int] = ()) -> None:
        self._sleeping = set(sleeping)

    def sleeping_stage_ids(self) -> set[int]:
        return set(self._sleeping)

    def record_sleep(self, stage_ids: Sequence[int], acks: Sequence[Mapping[str, Any]]) -> None:
        failed = failed_stage_ids(acks)
        self._sleeping.update(sid for sid in stage_ids if sid not in failed)

    def record_wake(
        self,
        stage_ids: Sequence[int],
        acks: Sequence[Mapping[str, Any]],
        tags: Sequence[str] | None,
    ) -> None:
        """A stage leaves the record when it really slept, its ACK is not ERROR and the wake
        covered all its memory: after ``tags=["weights"]`` its KV cache still sleeps."""
        if tags is not None and not set(tags) >= set(MEMORY_TAGS):
            return
        failed = failed_stage_ids(acks)
        self._sleeping.difference_update(sid for sid in stage_ids if sid not in failed)


def stage_states(engine_client: Any, sleeping: Iterable[int] = ()) -> StageStates:
    """How the routes learn which stages sleep for ``engine_client``. The method is looked up
    on the class, not the instance: mock engine clients answer every attribute."""
    if getattr(type(engine_client), "sleeping_stage_ids", None) is not None:
        return EngineStates(engine_client)
    return RecordedStates(sleeping)
