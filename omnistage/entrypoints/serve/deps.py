"""FastAPI dependencies of the server's routes, as ``Annotated`` aliases.

``EngineClientDep`` is ``app.state.engine_client`` (an ``AsyncOmni`` in the server, a fake in
tests), typed as the ``EngineClient`` protocol; ``SleepingStagesDep`` is
``app.state.sleeping_stages``, the set of stage ids the control routes have recorded as
sleeping. Routers apply the key checks with
``dependencies=[Depends(require_api_key)]`` or ``[Depends(require_control_key)]``; the aliases
below serve routes that prefer a parameter.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from omnistage.engine.protocol import EngineClient
from omnistage.entrypoints.serve.auth import require_api_key, require_control_key


async def get_engine_client(request: Request) -> EngineClient:
    """The engine client the app factory stored on ``app.state``."""
    engine: EngineClient = request.app.state.engine_client
    return engine


async def get_sleeping_stages(request: Request) -> set[int]:
    """``app.state.sleeping_stages``, created empty on first use if the factory did not set it."""
    state = request.app.state
    if getattr(state, "sleeping_stages", None) is None:
        state.sleeping_stages = set()
    sleeping: set[int] = state.sleeping_stages
    return sleeping


EngineClientDep = Annotated[EngineClient, Depends(get_engine_client)]
SleepingStagesDep = Annotated[set[int], Depends(get_sleeping_stages)]
ApiKeyDep = Annotated[None, Depends(require_api_key)]
ControlKeyDep = Annotated[None, Depends(require_control_key)]
