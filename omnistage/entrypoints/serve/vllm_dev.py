"""vLLM's development routes that RL clients call, over omnistage's stages (the first text
stage, as the other vLLM names): ``GET /get_world_size`` and ``GET /server_info`` (what TRL
reads before a weight sync), ``POST /collective_rpc`` (a documented subset of methods),
``POST /release_kv_cache_memory`` and ``POST /shutdown_weight_transfer_engine``. Operator
routes: they demand the control key. See ``docs/rl.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from omnistage import __version__
from omnistage.config import StageConfig
from omnistage.entrypoints.serve.auth import require_control_key
from omnistage.entrypoints.serve.deps import EngineClientDep, StageStatesDep
from omnistage.entrypoints.serve.omni_control.operations import (
    require_capability,
    sleep_stages,
    stage_statuses,
)
from omnistage.entrypoints.serve.omni_control.protocol import OmniControlResponse
from omnistage.entrypoints.serve.rl_routes import text_stage_id
from omnistage.errors import ConflictError, InvalidRequestError, StageDeadError
from omnistage.stage.ar.sampling_params import MAX_LOGPROBS
from omnistage.stage.kinds import stage_kind
from omnistage.stage.vocabulary import KV_CACHE

router = APIRouter(tags=["vLLM development API"], dependencies=[Depends(require_control_key)])


def _ranks(engine: Any, stage_id: int) -> int:
    return int(getattr(engine.config.stages[stage_id], "tensor_parallel_size", 1) or 1)


def _replicas(engine: Any, stage_id: int) -> int:
    return int(getattr(engine.config.stages[stage_id], "replicas", 1) or 1)


@router.get("/get_world_size")
async def get_world_size(engine: EngineClientDep, include_dp: bool = Query(True)) -> dict:
    """The ranks of the text stage: its tensor-parallel size times, with ``include_dp`` (as
    vLLM counts data-parallel engines), its replicas — a trainer joining them is rank 0 of
    ``world_size + 1``."""
    sid = text_stage_id(engine)
    replicas = _replicas(engine, sid) if include_dp else 1
    return {"world_size": _ranks(engine, sid) * replicas}


def _max_model_len(engine: Any, stage_id: int) -> int | None:
    """The stage's own limit (its checkpoint's when the config gives none)."""
    clients = getattr(engine, "clients", None)
    info = getattr(clients[stage_id], "info", None) if clients else None
    limit = getattr(info, "max_model_len", None)
    return limit if limit is not None else engine.config.stages[stage_id].ar.max_model_len


def server_config(request: Request, engine: Any) -> dict[str, Any]:
    """vLLM's ``VllmConfig`` in part: the fields RL clients read, of the text stage."""
    sid = text_stage_id(engine)
    stage: StageConfig = engine.config.stages[sid]
    ranks = _ranks(engine, sid)
    return {
        "model_config": {
            "model": str(stage.model),
            "served_model_name": request.app.state.served_model_name,
            "max_model_len": _max_model_len(engine, sid),
            "dtype": stage.dtype,
            "max_logprobs": MAX_LOGPROBS,
            "logprobs_mode": stage.ar.logprobs_mode,
            "enable_sleep_mode": stage.enable_sleep_mode,
        },
        "parallel_config": {
            "tensor_parallel_size": ranks,
            "pipeline_parallel_size": 1,
            "data_parallel_size": _replicas(engine, sid),
            "world_size": ranks,  # vLLM's: tensor x pipeline, without data parallelism
        },
        "cache_config": {
            "block_size": stage.ar.block_size,
            "enable_prefix_caching": stage.ar.enable_prefix_caching,
        },
        "scheduler_config": {
            "max_num_seqs": stage.ar.max_num_seqs,
            "max_num_batched_tokens": stage.ar.max_num_batched_tokens,
        },
        # Every text stage takes weight syncs (nccl: gloo on CPU; ipc on the same host).
        "weight_transfer_config": {"backend": "nccl"},
    }


@router.get("/server_info")
async def server_info(
    request: Request,
    engine: EngineClientDep,
    config_format: Annotated[Literal["text", "json"], Query()] = "text",
) -> dict[str, Any]:
    """``{"vllm_config": ...}`` as vLLM answers it (a text by default, a JSON tree with
    ``config_format=json``; a subset, see ``server_config``), plus omnistage's version."""
    config = server_config(request, engine)
    if config_format == "text":
        text = ", ".join(
            f"{name}.{key}={value!r}"
            for name, part in config.items()
            for key, value in part.items()
        )
        return {"vllm_config": text, "omnistage_version": __version__}
    return {"vllm_config": config, "omnistage_version": __version__}


# -- collective_rpc ------------------------------------------------------------------------


class RpcBody(BaseModel):
    """vLLM's body; ``args`` and ``kwargs`` must be empty for the methods offered here."""

    model_config = ConfigDict(extra="forbid")
    method: StrictStr = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: StrictFloat | StrictInt | None = Field(default=None, gt=0)


async def _check_health(engine: Any, stage_id: int) -> None:
    if stage_id in getattr(engine, "dead_stage_ids", list)():
        raise StageDeadError(stage_id)


async def _reset_prefix_cache(engine: Any, stage_id: int) -> None:
    await engine.reset_prefix_cache([stage_id])


async def _reload_weights(engine: Any, stage_id: int) -> None:
    """vLLM's ``reload_weights``: the checkpoint's weights again, from its folder."""
    require_capability(engine, "update_weights")
    await engine.update_weights(stage_id=stage_id, path=str(engine.config.stages[stage_id].model))


# The methods offered, each run once for the stage (every rank answers in it).
RPC_METHODS: dict[str, Callable[[Any, int], Awaitable[None]]] = {
    "check_health": _check_health,
    "reset_prefix_cache": _reset_prefix_cache,
    "reload_weights": _reload_weights,
}


@router.post("/collective_rpc")
async def collective_rpc(body: RpcBody, engine: EngineClientDep) -> dict[str, Any]:
    """``{"results": [null, ...]}``, one per rank, as vLLM answers it; another method (vLLM
    runs any worker method) is a 400 naming it. ``timeout`` bounds the wait (504 past it;
    the operation itself still completes)."""
    run = RPC_METHODS.get(body.method)
    if run is None:
        raise InvalidRequestError(
            "method", f"{body.method!r:.60} is not offered; the methods are {sorted(RPC_METHODS)}"
        )
    for name in ("args", "kwargs"):
        if getattr(body, name):
            raise InvalidRequestError(name, f"{body.method!r} takes none")
    sid = text_stage_id(engine)
    work = asyncio.ensure_future(run(engine, sid))
    await asyncio.wait_for(asyncio.shield(work), body.timeout)
    return {"results": [None] * _ranks(engine, sid)}


# -- KV cache and weight transfer -----------------------------------------------------------


class NoFields(BaseModel):
    """A body with nothing in it (``{}``), or none: a field is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")


@router.post("/release_kv_cache_memory", response_model_exclude_none=True)
async def release_kv_cache_memory(
    engine: EngineClientDep, states: StageStatesDep, body: NoFields | None = None
) -> OmniControlResponse:
    """vLLM's KV-only release: every stage with a KV cache drops it, its weights staying
    resident, and stops scheduling (requests in flight are kept and resume) until ``POST
    /wake_up?tags=kv_cache``. As vLLM, a stage whose memory is not all resident (asleep at
    level 1 or 2, or part-woken) is refused (409); a pause first (``/sleep?level=0``) is
    optional here."""
    require_capability(engine, "sleep")
    kinds = {s.stage_id: stage_kind(s.kind) for s in engine.config.stages}
    ids = [sid for sid, kind in kinds.items() if kind.has_prefix_cache]
    for status in await stage_statuses(engine):
        sid = status.get("stage_id")
        if sid not in ids:
            continue
        state, level = status.get("state"), status.get("level")
        resident = state == "awake" or (state == "asleep" and level == 0)
        if not resident or status.get("sleeping_tags"):
            raise ConflictError(
                "state",
                f"stage {sid} is {state}" + (f" at level {level}" if level else "")
                + ": its memory is not all resident; wake it first",
            )  # fmt: skip
    return await sleep_stages(engine, states, ids, 1, mode="keep", tags=[KV_CACHE])


class ShutdownBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(
    engine: EngineClientDep, body: ShutdownBody | None = None
) -> dict[str, Any]:
    """The trainer is done: its open update session (if any) ends unapplied, the weights
    serving stay. ``session`` names one started with ``require_session``. The stage's end of
    the trainer's group is dropped by the next ``init`` (which never reuses it)."""
    session = body.session if body else None
    try:
        await engine.abort_weight_update(text_stage_id(engine), session=session)
    except InvalidRequestError as exc:
        if session is not None or exc.field != "session":
            raise
        return {"status": "SUCCESS", "aborted_session": False}
    return {"status": "SUCCESS", "aborted_session": True}
