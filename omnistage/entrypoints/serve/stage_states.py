"""Which stages sleep, as the control routes see it: ``app.state.sleeping_stages``.

That set is the seed's contract, and clients and tests written for vLLM-Omni read and preset
it: the sleep route adds the stages it put to sleep, the wakeup route removes those it woke,
each only after the engine answered. Two ways to keep it:

- an engine client that reports its own truth (``AsyncOmni``: ``sleeping_stage_ids()``,
  which covers failed sleeps, automatic wakes, idle sleeps and restarts) is read, and the set
  is kept equal to it (``EngineStates``: on every read and after every control operation);
- an engine client that does not (vLLM-Omni's interface: ``sleep`` and ``wake_up`` only) gets
  what vLLM-Omni's own server keeps for it: the set is the record (``RecordedStates``).

Both read the set from the app's state each time, so a set assigned later is the one used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from omnistage.stage.vocabulary import MEMORY_TAGS

# The ACKs of one control operation, one per stage rank.
Acks = Sequence[Mapping[str, Any]]


class StageStates(Protocol):
    def sleeping_stage_ids(self) -> set[int]: ...
    def record_sleep(self, stage_ids: Sequence[int], acks: Acks) -> None: ...
    def record_wake(
        self, stage_ids: Sequence[int], acks: Acks, tags: Sequence[str] | None
    ) -> None: ...


def sleeping_set(state: Any) -> set[int]:
    """``state.sleeping_stages``, created empty if the app did not set it."""
    if getattr(state, "sleeping_stages", None) is None:
        state.sleeping_stages = set()
    sleeping: set[int] = state.sleeping_stages
    return sleeping


class EngineStates:
    """The engine client's own truth, mirrored into ``state.sleeping_stages``."""

    def __init__(self, engine_client: Any, state: Any) -> None:
        self.engine_client = engine_client
        self.state = state

    def sleeping_stage_ids(self) -> set[int]:
        truth = set(self.engine_client.sleeping_stage_ids())
        mirror = sleeping_set(self.state)
        if mirror != truth:  # in place: holders of the set see the change
            mirror.intersection_update(truth)
            mirror.update(truth)
        return truth

    def record_sleep(self, stage_ids: Sequence[int], acks: Acks) -> None:
        self.sleeping_stage_ids()

    def record_wake(self, stage_ids: Sequence[int], acks: Acks, tags: Sequence[str] | None) -> None:
        self.sleeping_stage_ids()


def failed_stage_ids(acks: Iterable[Mapping[str, Any]]) -> set[int]:
    """Stages with an ERROR ACK (any rank): their state did not change."""
    return {
        ack["stage_id"]
        for ack in acks
        if ack.get("status") == "ERROR" and isinstance(ack.get("stage_id"), int)
    }


class RecordedStates:
    """For an engine client without a truth of its own: ``state.sleeping_stages`` is the
    record of the stages its ACKs put to sleep."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def sleeping_stage_ids(self) -> set[int]:
        return set(sleeping_set(self.state))

    def record_sleep(self, stage_ids: Sequence[int], acks: Acks) -> None:
        failed = failed_stage_ids(acks)
        sleeping_set(self.state).update(sid for sid in stage_ids if sid not in failed)

    def record_wake(self, stage_ids: Sequence[int], acks: Acks, tags: Sequence[str] | None) -> None:
        """A stage leaves the record when it really slept, its ACK is not ERROR and the wake
        covered all its memory: after ``tags=["weights"]`` its KV cache still sleeps."""
        if tags is not None and not set(tags) >= set(MEMORY_TAGS):
            return
        failed = failed_stage_ids(acks)
        sleeping_set(self.state).difference_update(sid for sid in stage_ids if sid not in failed)


def stage_states(engine_client: Any, state: Any) -> StageStates:
    """How the routes learn which stages sleep for ``engine_client``, kept in ``state``'s
    ``sleeping_stages``. The method is looked up on the class, not the instance: mock engine
    clients answer every attribute."""
    sleeping_set(state)
    if getattr(type(engine_client), "sleeping_stage_ids", None) is not None:
        return EngineStates(engine_client, state)
    return RecordedStates(state)
