"""The RL routes: weight sync without disk (``/v1/omni/weights/*``, per stage), prefix cache
reset, abort by id — and vLLM's top-level names for the same, acting on the first text stage
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/get_weight_version``, ``/reset_prefix_cache``,
``/abort_requests``; ``vllm_dev`` has the rest of vLLM's development routes). Operator actions:
they demand the control key. See ``docs/rl.md``.

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
from omnistage.errors import InvalidRequestError
from omnistage.stage.kinds import stage_kind

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


def _finished(acks: list[dict[str, Any]]) -> dict[str, Any]:
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
    return _finished(acks)


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


# -- vLLM's names, for the first text stage --------------------------------------------------


def text_stage_id(engine: Any) -> int:
    """The stage vLLM's names act on: the first that outputs text."""
    return next(s.stage_id for s in engine.config.stages if stage_kind(s.kind).modality == "text")


def unpacked(info: dict[str, Any], field: str) -> dict[str, Any]:
    """``info`` without vLLM's ``packed`` flag, which only ``false`` may carry: omnistage
    receives each tensor on its own, never vLLM's packed buffers (TRL's trainer sends those)."""
    info = dict(info)
    if info.pop("packed", False) is not False:
        raise InvalidRequestError(
            f"{field}.packed",
            "packed broadcasts are not implemented: send each tensor on its own, as "
            "omnistage.rl.WeightSender does",
        )
    return info


# vLLM's bodies, lenient as vLLM's (unknown fields ignored), with omnistage's session fields.
class VllmInitBody(BaseModel):
    init_info: dict[str, Any] = Field(default_factory=dict)
    abort_open: StrictBool = False


class VllmStartBody(BaseModel):
    require_session: StrictBool = False
    abort_open: StrictBool = False


class VllmUpdateBody(BaseModel):
    update_info: dict[str, Any]
    session: Session | None = None


class VllmFinishBody(BaseModel):
    weight_version: StrictStr | StrictInt | None = None
    session: Session | None = None


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: VllmInitBody, engine: EngineClientDep) -> dict:
    info = unpacked(body.init_info, "init_info")
    backend = info.pop("backend", "nccl")
    if not isinstance(backend, str):
        raise InvalidRequestError("init_info.backend", "must be a string")
    return await engine.init_weight_transfer(
        text_stage_id(engine), backend, info, abort_open=body.abort_open
    )


@router.post("/start_weight_update")
async def start_weight_update(
    engine: EngineClientDep, body: VllmStartBody | None = None
) -> dict[str, Any]:
    body = body or VllmStartBody()
    return await engine.start_weight_update(
        text_stage_id(engine),
        None,
        require_session=body.require_session,
        abort_open=body.abort_open,
    )


@router.post("/update_weights")
async def vllm_update_weights(body: VllmUpdateBody, engine: EngineClientDep) -> dict:
    info = unpacked(body.update_info, "update_info")
    return await engine.receive_weights(text_stage_id(engine), info, session=body.session)


@router.post("/finish_weight_update")
async def finish_weight_update(engine: EngineClientDep, body: VllmFinishBody | None = None) -> dict:
    body = body or VllmFinishBody()
    acks = await engine.finish_weight_update(
        text_stage_id(engine), body.weight_version, session=body.session
    )
    return _finished(acks)


@router.get("/get_weight_version")
async def get_weight_version(engine: EngineClientDep) -> dict[str, Any]:
    return {"weight_version": engine.weight_version(text_stage_id(engine))}


@router.post("/reset_prefix_cache")
async def vllm_reset_prefix_cache(
    engine: EngineClientDep,
    reset_running_requests: bool = Query(default=False),
    reset_external: bool = Query(default=False),
) -> dict[str, Any]:
    """vLLM's ``{"success": true}`` (what TRL checks), with omnistage's fields. vLLM's query
    flags are accepted and need nothing here: a reset never has to preempt running requests
    (their blocks just stop being shared prefixes), and there is no external cache."""
    reset = await engine.reset_prefix_cache(None)
    return {"success": True, "status": "SUCCESS", "stage_ids": reset}


@router.post("/abort_requests")
async def abort_requests(body: AbortBody, engine: EngineClientDep) -> dict[str, Any]:
    await engine.abort_requests(body.request_ids)
    return {"status": "SUCCESS", "request_ids": body.request_ids}
