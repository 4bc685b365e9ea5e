"""FastAPI dependencies of the server's routes, as ``Annotated`` aliases.

``EngineClientDep`` is ``app.state.engine_client`` (an ``AsyncOmni`` in the server, a fake in
tests), typed as the ``EngineClient`` protocol; ``StageStatesDep`` is how the control routes
learn which stages sleep (``stage_states``: the engine client's own truth, or a record
for an engine client that keeps none; either way ``app.state.sleeping_stages`` says it). Routers apply the key checks with
``dependencies=[Depends(require_api_key)]`` or ``[Depends(require_control_key)]``; the aliases
below serve routes that prefer a parameter.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from omnistage.engine.protocol import EngineClient
from omnistage.entrypoints.serve.auth import require_api_key, require_control_key
from omnistage.entrypoints.serve.stage_states import StageStates, stage_states


async def get_engine_client(request: Request) -> EngineClient:
    """The engine client the app factory stored on ``app.state``."""
    engine: EngineClient = request.app.state.engine_client
    return engine


async def get_stage_states(request: Request) -> StageStates:
    """``app.state.stage_states``, made for the engine client on first use if the factory did
    not set it (keeping ``app.state.sleeping_stages``, the seed's set)."""
    state = request.app.state
    if getattr(state, "stage_states", None) is None:
        state.stage_states = stage_states(state.engine_client, state)
    states: StageStates = state.stage_states
    return states


EngineClientDep = Annotated[EngineClient, Depends(get_engine_client)]
StageStatesDep = Annotated[StageStates, Depends(get_stage_states)]
ApiKeyDep = Annotated[None, Depends(require_api_key)]
ControlKeyDep = Annotated[None, Depends(require_control_key)]
