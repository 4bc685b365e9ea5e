"""The ``/v1/omni/*`` control routes (vLLM-Omni's ``sleep`` and ``wakeup`` plus extensions).

Each route depends only on ``app.state.engine_client`` (and what it says of which stages sleep,
``stage_states.py``) and demands the control key. Bodies holding only vLLM-Omni's fields produce exactly vLLM-Omni's engine
calls; see :mod:`.operations` for the bookkeeping. Engine exceptions reach the app's handlers.

Status codes: 200 with ``status`` SUCCESS, SKIPPED or ERROR (SKIPPED: nothing had to change;
ERROR: some stage's ACK reports a failure, the ACKs say which); 400 bad body or unknown stage id; 401 missing/wrong key; 409 a
conflicting transition is running; 501 the engine cannot do it; 503 a stage is dead.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query, Request

from omnistage.entrypoints.serve.auth import require_control_key
from omnistage.entrypoints.serve.deps import EngineClientDep, StageStatesDep
from omnistage.entrypoints.serve.omni_control.journal import JOURNAL_LENGTH, OmniAcksResponse
from omnistage.entrypoints.serve.omni_control.operations import (
    pause_stages,
    resume_stages,
    sleep_stages,
    stage_statuses,
    update_stage_weights,
    wake_stages,
)
from omnistage.entrypoints.serve.omni_control.protocol import (
    ControlRequest,
    OmniControlResponse,
    OmniPauseRequest,
    OmniResumeRequest,
    OmniSleepRequest,
    OmniStagesResponse,
    OmniUpdateWeightsRequest,
    OmniWakeupRequest,
)

logger = logging.getLogger(__name__)

router = APIRouter(
    prefix="/v1/omni", tags=["omni control"], dependencies=[Depends(require_control_key)]
)


def _warn_ignored(route: str, body: ControlRequest | None) -> None:
    if body is not None and body.ignored_fields:
        logger.warning("POST %s: ignoring unknown body fields %s", route, body.ignored_fields)


@router.post("/sleep", response_model_exclude_none=True)
async def omni_sleep(
    body: OmniSleepRequest, engine_client: EngineClientDep, states: StageStatesDep
) -> OmniControlResponse:
    """Put ``stage_ids`` to sleep at ``level``; they are recorded as sleeping."""
    _warn_ignored("/v1/omni/sleep", body)
    return await sleep_stages(
        engine_client, states, body.stage_ids, body.level, mode=body.mode, tags=body.tags,
        replica_ids=body.replica_ids,
    )  # fmt: skip


@router.post("/wakeup", response_model_exclude_none=True)
async def omni_wakeup(
    body: OmniWakeupRequest, engine_client: EngineClientDep, states: StageStatesDep
) -> OmniControlResponse:
    """Wake the sleeping ones among ``stage_ids``; SKIPPED (engine not called) if none sleeps."""
    _warn_ignored("/v1/omni/wakeup", body)
    return await wake_stages(
        engine_client,
        states,
        body.stage_ids,
        tags=body.tags,
        reload=body.reload,
        resume=body.resume,
        replica_ids=body.replica_ids,
    )


@router.get("/stages", response_model=OmniStagesResponse)
async def omni_stages(engine_client: EngineClientDep, states: StageStatesDep) -> OmniStagesResponse:
    """Per-stage state, level, sleeping tags, paused flag, in-flight counts and memory."""
    stages = await stage_statuses(engine_client)
    states.sleeping_stage_ids()  # app.state.sleeping_stages follows what the engine says
    return OmniStagesResponse(stages=stages)


@router.get("/acks", response_model=OmniAcksResponse)
async def omni_acks(
    request: Request,
    limit: int = Query(default=JOURNAL_LENGTH, ge=1, le=JOURNAL_LENGTH),
    after: int = Query(default=0, ge=0),
) -> OmniAcksResponse:
    """The last control operations (sleep, wake_up, update_weights) with their ACKs, oldest
    first, whatever started them; ``after``: only those with a greater ``seq``."""
    journal = getattr(request.app.state, "control_journal", None)
    if journal is None:
        return OmniAcksResponse(operations=[])
    return OmniAcksResponse(operations=journal.entries(limit, after), last_seq=journal.last_seq)


@router.post("/pause", response_model_exclude_none=True)
async def omni_pause(
    engine_client: EngineClientDep, body: Annotated[OmniPauseRequest | None, Body()] = None
) -> OmniControlResponse:
    """Stop scheduling on ``stage_ids`` (no body: every stage) with ``mode`` (default abort)."""
    _warn_ignored("/v1/omni/pause", body)
    body = body or OmniPauseRequest()
    return await pause_stages(engine_client, body.stage_ids, body.mode)


@router.post("/resume", response_model_exclude_none=True)
async def omni_resume(
    engine_client: EngineClientDep, body: Annotated[OmniResumeRequest | None, Body()] = None
) -> OmniControlResponse:
    """Resume scheduling on ``stage_ids`` (no body: every stage)."""
    _warn_ignored("/v1/omni/resume", body)
    return await resume_stages(engine_client, body.stage_ids if body else None)


@router.post("/update_weights", response_model_exclude_none=True)
async def omni_update_weights(
    body: OmniUpdateWeightsRequest, engine_client: EngineClientDep
) -> OmniControlResponse:
    """Load the safetensors checkpoint at ``path`` into stage ``stage_id``'s weights in place."""
    _warn_ignored("/v1/omni/update_weights", body)
    return await update_stage_weights(engine_client, body.stage_id, body.path)
