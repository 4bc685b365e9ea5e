"""vLLM's top-level RL routes, acting on the first text stage: ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/get_weight_version``, ``/reset_prefix_cache``, ``/abort_requests`` (``vllm_dev`` has the
rest of vLLM's development routes). The same per stage under ``/v1/omni/*``:
``omni_control/rl.py``, whose sessions these follow. Operator actions: they demand the control
key. See ``docs/rl.md``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from omnistage.entrypoints.serve.auth import require_control_key
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.entrypoints.serve.omni_control import rl as omni_rl
from omnistage.entrypoints.serve.omni_control.rl import AbortBody, Session, finished
from omnistage.errors import InvalidRequestError
from omnistage.stage.kinds import stage_kind

router = APIRouter(tags=["RL"], dependencies=[Depends(require_control_key)])


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
    return finished(acks)


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
    return await omni_rl.reset_prefix_cache(engine)  # every stage with a prefix cache


@router.post("/abort_requests")
async def abort_requests(body: AbortBody, engine: EngineClientDep) -> dict[str, Any]:
    return await omni_rl.abort(body, engine)
