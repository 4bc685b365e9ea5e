"""The RL control routes under ``/v1/omni/*``, per stage: weight sync without disk
(``/v1/omni/weights/{init,start,update,finish,abort,checksum}``), prefix cache reset, abort by
id. Operator actions: they demand the control key. vLLM's top-level names for the same live in
``../rl_routes.py``. See ``docs/rl.md``.

A weight update is a session: ``start`` answers ``{"started": true, "session": id}`` and
``update``/``finish`` pass ``session`` back. A second ``start`` (or ``init``) while one is
open, or an ``update``/``finish`` naming another session, is a 409 ``conflict`` naming
``session`` — unless it says ``abort_open: true``. A session started without
``require_session: true`` may be continued without its id (vLLM's clients send none).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from omnistage.entrypoints.serve.auth import require_control_key
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.entrypoints.serve.omni_control.operations import check_stage_ids

router = APIRouter(tags=["RL"], dependencies=[Depends(require_control_key)])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


Session = Annotated[StrictStr, Field(min_length=1, max_length=128)]


class InitBody(_Body):
    stage_id: StrictInt = Field(default=0, ge=0)
    backend: StrictStr = "nccl"
    init_info: dict[str, Any] = Field(default_factory=dict)
    abort_open: StrictBool = False


class StartBody(_Body):
    stage_id: StrictInt = Field(default=0, ge=0)
    update_info: dict[str, Any] | None = None
    require_session: StrictBool = False
    abort_open: StrictBool = False


class UpdateBody(_Body):
    stage_id: StrictInt = Field(default=0, ge=0)
    update_info: dict[str, Any]
    session: Session | None = None


class FinishBody(_Body):
    stage_id: StrictInt = Field(default=0, ge=0)
    weight_version: StrictStr | StrictInt | None = None
    session: Session | None = None


class AbortUpdateBody(_Body):
    stage_id: StrictInt = Field(default=0, ge=0)
    session: Session | None = None


class StageIdsBody(_Body):
    stage_ids: list[StrictInt] | None = None


class AbortBody(_Body):
    request_ids: list[StrictStr] = Field(min_length=1)


def finished(acks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"status": acks[0]["status"], "acks": acks}


# -- /v1/omni/* (any stage) ----------------------------------------------------------------


@router.post("/v1/omni/weights/init")
async def init_weights(body: InitBody, engine: EngineClientDep) -> dict[str, Any]:
    """Join a trainer (``nccl``: answers once the trainer's rank 0 joins too; the stage
    serves meanwhile)."""
    check_stage_ids(engine, [body.stage_id], field="stage_id")
    return await engine.init_weight_transfer(
        body.stage_id, body.backend, body.init_info, abort_open=body.abort_open
    )


@router.post("/v1/omni/weights/start")
async def start_weights(body: StartBody, engine: EngineClientDep) -> dict[str, Any]:
    """Open an update session; ``update_info`` may announce every tensor, checked up front
    (and then all must arrive before ``finish`` applies anything)."""
    check_stage_ids(engine, [body.stage_id], field="stage_id")
    return await engine.start_weight_update(
        body.stage_id, body.update_info,
        require_session=body.require_session, abort_open=body.abort_open,
    )  # fmt: skip


@router.post("/v1/omni/weights/update")
async def update_weights(body: UpdateBody, engine: EngineClientDep) -> dict[str, Any]:
    """Receive one chunk (names, dtype names, shapes; ``ipc_handles`` for ``ipc``)."""
    check_stage_ids(engine, [body.stage_id], field="stage_id")
    return await engine.receive_weights(body.stage_id, body.update_info, session=body.session)


@router.post("/v1/omni/weights/finish")
async def finish_weights(body: FinishBody, engine: EngineClientDep) -> dict[str, Any]:
    """Apply the session's update in place, all or nothing, as ``weight_version``."""
    check_stage_ids(engine, [body.stage_id], field="stage_id")
    acks = await engine.finish_weight_update(
        body.stage_id, body.weight_version, session=body.session
    )
    return finished(acks)


@router.post("/v1/omni/weights/abort")
async def abort_weights(
    engine: EngineClientDep, body: AbortUpdateBody | None = None
) -> dict[str, Any]:
    """End the caller's own update session without applying it (409 for another's)."""
    body = body or AbortUpdateBody()
    check_stage_ids(engine, [body.stage_id], field="stage_id")
    return await engine.abort_weight_update(body.stage_id, session=body.session)


@router.get("/v1/omni/weights/checksum")
async def weights_checksum(
    engine: EngineClientDep, stage_id: int = Query(default=0, ge=0)
) -> dict[str, Any]:
    """SHA-256 of the stage's weights (``omnistage.rl.weights_checksum`` on the trainer)."""
    check_stage_ids(engine, [stage_id], field="stage_id")
    return {
        "stage_id": stage_id,
        "checksum": await engine.weights_checksum(stage_id),
        "weight_version": engine.weight_version(stage_id),
    }


@router.post("/v1/omni/reset_prefix_cache")
async def reset_prefix_cache(
    engine: EngineClientDep, body: StageIdsBody | None = None
) -> dict[str, Any]:
    stage_ids = body.stage_ids if body else None
    if stage_ids is not None:
        check_stage_ids(engine, stage_ids)
    reset = await engine.reset_prefix_cache(stage_ids)
    return {"success": True, "status": "SUCCESS", "stage_ids": reset}


@router.post("/v1/omni/abort")
async def abort(body: AbortBody, engine: EngineClientDep) -> dict[str, Any]:
    """End these requests as aborted, wherever they are (unknown ids are ignored)."""
    await engine.abort_requests(body.request_ids)
    return {"status": "SUCCESS", "request_ids": body.request_ids}
