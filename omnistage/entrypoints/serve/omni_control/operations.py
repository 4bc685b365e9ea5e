"""The control operations behind ``/v1/omni/*`` and vLLM's ``/sleep`` family.

The HTTP layer only validates, forwards and aggregates ACKs; the engine client does the work.
Two rules from vLLM-Omni's serving code shape this module:

- Capability is probed with ``hasattr`` (501 when missing), and a body holding only vLLM-Omni's
  fields produces exactly vLLM-Omni's engine call (``sleep(stage_ids=, level=)``,
  ``wake_up(stage_ids=)``); extension fields are passed only when the client sent them.
- A wakeup of stages none of which sleeps answers SKIPPED without calling the engine; which
  stages sleep is the engine client's truth (``stage_states.py``), read before every decision.

Answers have one shape: ``{"status", "acks"}`` with one ACK per stage and rank, plus a
``reason`` when the status is SKIPPED (nothing had to change: a repeated sleep or wake) or
ERROR. Engine exceptions are not caught here: the app's exception handlers turn them into
responses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
from fastapi import HTTPException

from omnistage.entrypoints.serve.omni_control.protocol import OmniControlResponse
from omnistage.entrypoints.serve.stage_states import StageStates
from omnistage.stage.control import Ack, make_ack
from omnistage.stage.vocabulary import ALREADY_SLEEPING, NOT_SLEEPING
from omnistage.stage.vocabulary import check_stage_ids as check_ids

_SLEEP_METHODS = frozenset({"sleep", "wake_up"})


def require_capability(engine_client: Any, method: str) -> None:
    """Raise 501 unless the engine client offers ``method``.

    ``sleep`` and ``wake_up`` are also refused when the client declares
    ``sleep_mode_enabled = False`` (a server started without ``--enable-sleep-mode``): its
    methods exist, but no stage can sleep, and wakeup must answer 501 rather than SKIPPED.
    """
    if method in _SLEEP_METHODS and getattr(engine_client, "sleep_mode_enabled", True) is False:
        raise HTTPException(
            status_code=501,
            detail=f"Engine does not support {method}: the server was started without "
            "--enable-sleep-mode",
        )
    if not hasattr(engine_client, method):
        raise HTTPException(status_code=501, detail=f"Engine does not support {method}")


def check_stage_ids(engine_client: Any, stage_ids: Iterable[int], field: str = "stage_ids") -> None:
    """Refuse ids outside ``0..num_stages-1`` (400 naming ``field`` and the valid range), with
    the engine client's own check. Engine clients without an integer ``num_stages``
    (vLLM-Omni's) validate ids themselves."""
    num_stages = getattr(engine_client, "num_stages", None)
    if isinstance(num_stages, int) and not isinstance(num_stages, bool):
        check_ids(stage_ids, num_stages, field)


def ack_to_dict(ack: Any) -> dict[str, Any]:
    """An ACK as a plain dict, whether the engine returned a dict, dataclass or msgspec Struct."""
    if isinstance(ack, Ack):
        return ack.to_dict()
    if isinstance(ack, Mapping):
        return dict(ack)
    if dataclasses.is_dataclass(ack) and not isinstance(ack, type):
        return dataclasses.asdict(ack)
    if isinstance(ack, msgspec.Struct):
        return dict(msgspec.to_builtins(ack))
    raise TypeError(f"engine returned an ACK of unsupported type {type(ack).__name__}")


def normalize_acks(acks: Iterable[Any] | None) -> list[dict[str, Any]]:
    """The engine's ACK list (one per stage and rank) as dicts; ``None`` counts as no ACKs."""
    return [ack_to_dict(ack) for ack in acks or ()]


def skipped_acks(stage_ids: Sequence[int], reason: str) -> list[dict[str, Any]]:
    """The ACKs of stages an operation left alone, answered without calling the engine."""
    return [make_ack(sid, status="SKIPPED", error_msg=reason).to_dict() for sid in stage_ids]


def summarize(acks: list[dict[str, Any]], skipped_reason: str = "") -> OmniControlResponse:
    """ERROR (a reason naming the failed stages) if any ACK failed; SKIPPED (``skipped_reason``)
    if every ACK is SKIPPED; else SUCCESS."""
    errors = [ack for ack in acks if ack.get("status") == "ERROR"]
    if errors:
        reason = "; ".join(
            f"stage {ack.get('stage_id')}: {ack.get('error_msg') or 'failed'}" for ack in errors
        )
        return OmniControlResponse(status="ERROR", acks=acks, reason=reason)
    if acks and skipped_reason and all(ack.get("status") == "SKIPPED" for ack in acks):
        return OmniControlResponse(status="SKIPPED", acks=acks, reason=skipped_reason)
    return OmniControlResponse(status="SUCCESS", acks=acks)


def _sent(**options: Any) -> dict[str, Any]:
    """The options the client really sent (``None`` means absent)."""
    return {name: value for name, value in options.items() if value is not None}


async def sleep_stages(
    engine_client: Any,
    states: StageStates,
    stage_ids: list[int],
    level: int,
    *,
    mode: str | None = None,
    tags: Sequence[str] | None = None,
    replica_ids: Sequence[int] | None = None,
) -> OmniControlResponse:
    """Sleep ``stage_ids`` (``replica_ids``: those replicas of each); SKIPPED when every one
    was asleep already."""
    require_capability(engine_client, "sleep")
    check_stage_ids(engine_client, stage_ids)
    try:
        acks = normalize_acks(
            await engine_client.sleep(
                stage_ids=stage_ids,
                level=level,
                **_sent(mode=mode, tags=tags, replica_ids=replica_ids),
            )
        )
    finally:  # an engine with its own truth may have slept some stages before failing
        states.sleeping_stage_ids()
    states.record_sleep(stage_ids, acks)
    return summarize(acks, ALREADY_SLEEPING)


async def wake_stages(
    engine_client: Any,
    states: StageStates,
    stage_ids: list[int],
    *,
    tags: Sequence[str] | None = None,
    reload: bool | None = None,
    resume: bool | None = None,
    replica_ids: Sequence[int] | None = None,
) -> OmniControlResponse:
    """Wake ``stage_ids`` if any of them sleeps, else SKIPPED without calling the engine
    (with ``replica_ids`` the engine is asked: a replica may sleep in a stage that serves)."""
    require_capability(engine_client, "wake_up")
    check_stage_ids(engine_client, stage_ids)
    if replica_ids is None and not states.sleeping_stage_ids() & set(stage_ids):
        acks = skipped_acks(stage_ids, "not asleep")
        return OmniControlResponse(status="SKIPPED", acks=acks, reason=NOT_SLEEPING)
    try:
        acks = normalize_acks(
            await engine_client.wake_up(
                stage_ids=stage_ids,
                **_sent(tags=tags, reload=reload, resume=resume, replica_ids=replica_ids),
            )
        )
    finally:
        states.sleeping_stage_ids()
    states.record_wake(stage_ids, acks, tags)
    return summarize(acks, NOT_SLEEPING)


async def pause_stages(
    engine_client: Any, stage_ids: list[int] | None, mode: str
) -> OmniControlResponse:
    """Stop scheduling on ``stage_ids`` (``None``: every stage); ``mode`` as for sleep."""
    require_capability(engine_client, "pause_generation")
    if stage_ids is not None:
        check_stage_ids(engine_client, stage_ids)
    result = await engine_client.pause_generation(stage_ids=stage_ids, mode=mode)
    return summarize(normalize_acks(result if isinstance(result, list) else None))


async def resume_stages(engine_client: Any, stage_ids: list[int] | None) -> OmniControlResponse:
    """Resume scheduling on ``stage_ids`` (``None``: every stage)."""
    require_capability(engine_client, "resume_generation")
    if stage_ids is not None:
        check_stage_ids(engine_client, stage_ids)
    result = await engine_client.resume_generation(stage_ids=stage_ids)
    return summarize(normalize_acks(result if isinstance(result, list) else None))


async def stage_statuses(engine_client: Any) -> list[dict[str, Any]]:
    """The engine's per-stage status dicts."""
    require_capability(engine_client, "stage_status")
    return [dict(status) for status in await engine_client.stage_status()]


async def update_stage_weights(engine_client: Any, stage_id: int, path: str) -> OmniControlResponse:
    """Load the checkpoint at ``path`` into stage ``stage_id``'s weights in place."""
    require_capability(engine_client, "update_weights")
    check_stage_ids(engine_client, [stage_id], field="stage_id")
    acks = await engine_client.update_weights(stage_id=stage_id, path=path)
    return summarize(normalize_acks(acks if isinstance(acks, list) else [acks]))
