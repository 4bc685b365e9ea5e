"""vLLM's sleep API (``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/pause``, ``/resume``,
``/is_paused``) over omnistage's stages, for RL frameworks that speak it (verl, TRL, OpenRLHF).

vLLM has one engine; here each route acts on every stage (``/wake_up``: every sleeping stage)
with the same bookkeeping as ``/v1/omni/*``. Parameters are query parameters, as vLLM's:
``/sleep?level=1&mode=abort`` (level defaults to 1, as vLLM), ``/wake_up?tags=weights&tags=kv_cache``
(plus omnistage's ``reload=false``), ``/pause?mode=keep``. Replies are the ``/v1/omni/*`` JSON
bodies (vLLM replies with an empty 200; its clients only look at the status).
``/is_paused`` is true when any stage is paused.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from omnistage.entrypoints.serve.auth import require_control_key
from omnistage.entrypoints.serve.deps import EngineClientDep, StageStatesDep
from omnistage.entrypoints.serve.omni_control.operations import (
    pause_stages,
    resume_stages,
    sleep_stages,
    stage_statuses,
    wake_stages,
)
from omnistage.entrypoints.serve.omni_control.protocol import (
    IsPausedResponse,
    IsSleepingResponse,
    MemoryTags,
    OmniControlResponse,
    QuerySleepLevel,
    SleepMode,
)

router = APIRouter(tags=["vLLM sleep API"], dependencies=[Depends(require_control_key)])


@router.post("/sleep", response_model_exclude_none=True)
async def sleep(
    engine_client: EngineClientDep,
    states: StageStatesDep,
    level: Annotated[QuerySleepLevel, Query()] = 1,
    mode: Annotated[SleepMode, Query()] = "abort",
) -> OmniControlResponse:
    """Put every stage to sleep."""
    all_stage_ids = list(range(engine_client.num_stages))
    return await sleep_stages(engine_client, states, all_stage_ids, level, mode=mode)


@router.post("/wake_up", response_model_exclude_none=True)
async def wake_up(
    engine_client: EngineClientDep,
    states: StageStatesDep,
    tags: Annotated[MemoryTags | None, Query()] = None,
    reload: bool | None = None,
) -> OmniControlResponse:
    """Wake every sleeping stage (``tags``: only that memory); SKIPPED if none sleeps."""
    sleeping = sorted(states.sleeping_stage_ids())
    return await wake_stages(engine_client, states, sleeping, tags=tags, reload=reload)


@router.get("/is_sleeping", response_model=IsSleepingResponse)
async def is_sleeping(states: StageStatesDep) -> IsSleepingResponse:
    """True while any stage sleeps."""
    return IsSleepingResponse(is_sleeping=bool(states.sleeping_stage_ids()))


@router.post("/pause", response_model_exclude_none=True)
async def pause(
    engine_client: EngineClientDep, mode: Annotated[SleepMode, Query()] = "abort"
) -> OmniControlResponse:
    """Stop scheduling on every stage."""
    return await pause_stages(engine_client, None, mode)


@router.post("/resume", response_model_exclude_none=True)
async def resume(engine_client: EngineClientDep) -> OmniControlResponse:
    """Resume scheduling on every stage."""
    return await resume_stages(engine_client, None)


@router.get("/is_paused", response_model=IsPausedResponse)
async def is_paused(engine_client: EngineClientDep) -> IsPausedResponse:
    """True while any stage is paused."""
    statuses = await stage_statuses(engine_client)
    return IsPausedResponse(is_paused=any(status.get("paused") for status in statuses))
