"""The control operations behind ``/v1/omni/*`` and vLLM's ``/sleep`` family.

The HTTP layer only validates, forwards and aggregates ACKs; the engine client does the work.
Two rules from vLLM-Omni's serving code shape this module:

- Capability is probed with ``hasattr`` (501 when missing), and a body holding only vLLM-Omni's
  fields produces exactly vLLM-Omni's engine call (``sleep(stage_ids=, level=)``,
  ``wake_up(stage_ids=)``); extension fields are passed only when the client sent them.
- ``sleeping`` (``app.state.sleeping_stages``) is the set the wakeup route consults to answer
  SKIPPED without calling the engine. It is updated from the ACKs (a stage whose ACK says ERROR
  did not change state) and, for engine clients that report it, replaced by the engine's own
  truth (``sleeping_stage_ids()``) before every decision and after every operation, whether the
  operation returned or raised — so a failed sleep, a wake error, a dead stage or an automatic
  wake never leaves it stale. Engine exceptions are not caught here: the app's exception
  handlers turn them into responses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
from fastapi import HTTPException

from omnistage.entrypoints.serve.omni_control.protocol import ALL_MEMORY_TAGS, OmniControlResponse
from omnistage.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SKIPPED_REASON = "Target stages are not sleeping."
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
    """Refuse ids outside ``0..num_stages-1`` (400 naming ``field`` and the valid range).

    Engine clients without an integer ``num_stages`` (vLLM-Omni's) validate ids themselves.
    """
    num_stages = getattr(engine_client, "num_stages", None)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool):
        return
    unknown = sorted({sid for sid in stage_ids if sid >= num_stages})
    if unknown:
        raise InvalidRequestError(
            field, f"unknown stage id(s) {unknown}; valid ids are 0..{num_stages - 1}"
        )


def ack_to_dict(ack: Any) -> dict[str, Any]:
    """An ACK as a plain dict, whether the engine returned a dict, dataclass or msgspec Struct."""
    if isinstance(ack, Mapping):
        return dict(ack)
    if dataclasses.is_dataclass(ack) and not isinstance(ack, type):
        return dataclasses.asdict(ack)
    if isinstance(ack, msgspec.Struct):
        return dict(msgspec.to_builtins(ack))
    raise TypeError(f"engine returned an ACK of unsupported type {type(ack).__name__}")


def normalize_acks(acks: Iterable[Any] | None) -> list[dict[str, Any]]:
    """The engine's ACK list as dicts (``None`` counts as no ACKs); a tensor-parallel
    stage's ACK is followed by its other ranks' (one ACK per rank, vLLM-Omni's shape)."""
    flat: list[dict[str, Any]] = []
    for ack in acks or ():
        data = ack_to_dict(ack)
        ranks = [ack_to_dict(r) for r in data.pop("rank_acks", None) or []]
        for rank in ranks:
            rank.pop("rank_acks", None)
        flat += [data, *ranks]
    return flat


def failed_stage_ids(acks: Iterable[Mapping[str, Any]]) -> set[int]:
    """Stages with an ERROR ACK (any rank): their state did not change."""
    return {
        ack["stage_id"]
        for ack in acks
        if ack.get("status") == "ERROR" and isinstance(ack.get("stage_id"), int)
    }


def summarize(acks: list[dict[str, Any]]) -> OmniControlResponse:
    """SUCCESS with the ACKs, or ERROR with the ACKs and a reason naming the failed stages."""
    errors = [ack for ack in acks if ack.get("status") == "ERROR"]
    if not errors:
        return OmniControlResponse(status="SUCCESS", acks=acks)
    reason = "; ".join(
        f"stage {ack.get('stage_id')}: {ack.get('error_msg') or 'failed'}" for ack in errors
    )
    return OmniControlResponse(status="ERROR", acks=acks, reason=reason)


def engine_sleeping_stage_ids(engine_client: Any) -> set[int] | None:
    """The engine's own sleeping set, or ``None`` for engine clients that do not report it.

    The method is looked up on the class, not the instance: mock engine clients answer every
    attribute, and their answer is not the truth.
    """
    if getattr(type(engine_client), "sleeping_stage_ids", None) is None:
        return None
    return set(engine_client.sleeping_stage_ids())


def sync_with_engine(sleeping: set[int], engine_client: Any) -> None:
    """Replace ``sleeping``'s contents (in place) with the engine's truth when it reports one."""
    truth = engine_sleeping_stage_ids(engine_client)
    if truth is None or truth == sleeping:
        return
    logger.info(
        "sleeping stages reconciled with the engine: %s -> %s", sorted(sleeping), sorted(truth)
    )
    sleeping.clear()
    sleeping.update(truth)


def _sent(**options: Any) -> dict[str, Any]:
    """The options the client really sent (``None`` means absent)."""
    return {name: value for name, value in options.items() if value is not None}


async def sleep_stages(
    engine_client: Any,
    sleeping: set[int],
    stage_ids: list[int],
    level: int,
    *,
    mode: str | None = None,
    tags: Sequence[str] | None = None,
) -> OmniControlResponse:
    """Sleep ``stage_ids``; the stages that did not fail are recorded as sleeping."""
    require_capability(engine_client, "sleep")
    check_stage_ids(engine_client, stage_ids)
    try:
        acks = normalize_acks(
            await engine_client.sleep(
                stage_ids=stage_ids, level=level, **_sent(mode=mode, tags=tags)
            )
        )
        failed = failed_stage_ids(acks)
        sleeping.update(sid for sid in stage_ids if sid not in failed)
    finally:
        sync_with_engine(sleeping, engine_client)
    return summarize(acks)


async def wake_stages(
    engine_client: Any,
    sleeping: set[int],
    stage_ids: list[int],
    *,
    tags: Sequence[str] | None = None,
    reload: bool | None = None,
    resume: bool | None = None,
) -> OmniControlResponse:
    """Wake ``stage_ids`` if any of them sleeps (else SKIPPED, engine not called).

    A stage leaves ``sleeping`` only when it really slept, its ACK is not ERROR, and the wake
    covered all its memory (no ``tags``, or all tags): after ``tags=["weights"]`` its KV cache
    still sleeps and a later ``tags=["kv_cache"]`` wakeup must not be skipped.
    """
    require_capability(engine_client, "wake_up")
    check_stage_ids(engine_client, stage_ids)
    sync_with_engine(sleeping, engine_client)
    if not any(sid in sleeping for sid in stage_ids):
        return OmniControlResponse(status="SKIPPED", reason=SKIPPED_REASON)
    try:
        acks = normalize_acks(
            await engine_client.wake_up(
                stage_ids=stage_ids, **_sent(tags=tags, reload=reload, resume=resume)
            )
        )
        if tags is None or set(tags) >= ALL_MEMORY_TAGS:
            failed = failed_stage_ids(acks)
            sleeping.difference_update({sid for sid in stage_ids if sid not in failed})
    finally:
        sync_with_engine(sleeping, engine_client)
    return summarize(acks)


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


async def stage_statuses(engine_client: Any, sleeping: set[int]) -> list[dict[str, Any]]:
    """The engine's per-stage status dicts (and ``sleeping`` brought up to date)."""
    require_capability(engine_client, "stage_status")
    statuses = [dict(status) for status in await engine_client.stage_status()]
    sync_with_engine(sleeping, engine_client)
    return statuses


async def update_stage_weights(engine_client: Any, stage_id: int, path: str) -> OmniControlResponse:
    """Load the checkpoint at ``path`` into stage ``stage_id``'s weights in place."""
    require_capability(engine_client, "update_weights")
    check_stage_ids(engine_client, [stage_id], field="stage_id")
    ack = await engine_client.update_weights(stage_id=stage_id, path=path)
    return summarize(normalize_acks([ack]))
