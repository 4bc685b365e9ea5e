"""``GET /v1/models``, ``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from omnistage.entrypoints.openai.replies import now

models_router = APIRouter(tags=["openai"])
health_router = APIRouter(tags=["health"])


@models_router.get("/v1/models")
async def list_models(request: Request) -> Any:
    """One entry per served name (``--served-model-name`` may give several), as vLLM."""
    state = request.app.state
    engine = state.engine_client
    names = getattr(state, "served_model_names", None) or [state.served_model_name]
    stages = [
        {"stage_id": s.stage_id, "kind": s.kind, "name": s.display_name}
        for s in engine.config.stages
    ]
    card = {
        "object": "model",
        "created": now(),
        "owned_by": "omnistage",
        "modalities": engine.output_modalities(),
        "stages": stages,
    }
    return {"object": "list", "data": [{"id": name, **card} for name in names]}


@health_router.get("/health")
async def health(request: Request) -> Any:
    engine = request.app.state.engine_client
    dead = engine.dead_stage_ids()
    if dead:
        restarting: list[int] = getattr(engine, "restarting_stage_ids", list)()
        body = {"status": "unhealthy", "dead_stage_ids": dead, "restarting_stage_ids": restarting}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    return {"status": "ok"}


@health_router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = request.app.state.engine_client
    statuses = await engine.stage_status() if hasattr(engine, "stage_status") else []
    body = request.app.state.metrics.render(engine, statuses)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
