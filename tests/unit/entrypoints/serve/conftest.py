"""Fake engine clients and a bare FastAPI app holding the control routers.

``SeedEngine`` has only vLLM-Omni's interface (``sleep`` and ``wake_up``; no ``num_stages``, no
``sleeping_stage_ids``), as the seed's route tests use. ``FakeEngine`` has the whole AsyncOmni
control interface and keeps its own truth of which stages sleep. Both record every engine
operation as ``(method, keyword arguments)``; their methods take keywords only, so a positional
call fails the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.testclient import TestClient

from omnistage.entrypoints.serve import vllm_compat
from omnistage.entrypoints.serve.auth import require_api_key
from omnistage.entrypoints.serve.errors import register_exception_handlers
from omnistage.entrypoints.serve.omni_control.routes import router as omni_control_router
from omnistage.entrypoints.serve.stage_states import stage_states
from omnistage.errors import StageBusyError
from omnistage.stage.control import make_ack


class SeedEngine:
    """vLLM-Omni's engine-client interface: ``sleep`` and ``wake_up`` only."""

    def __init__(
        self,
        *,
        error_stages: Iterable[int] = (),
        sleep_error: Exception | None = None,
        wake_error: Exception | None = None,
    ) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.error_stages = set(error_stages)
        self.sleep_error = sleep_error
        self.wake_error = wake_error

    def _acks(self, stage_ids: list[int], **metadata: Any) -> list[dict[str, Any]]:
        return [
            make_ack(sid, status="ERROR", error_msg="out of host memory", **metadata)
            if sid in self.error_stages
            else make_ack(sid, freed_bytes=1024, **metadata)
            for sid in stage_ids
        ]

    async def sleep(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(("sleep", kwargs))
        if self.sleep_error is not None:
            raise self.sleep_error
        return self._acks(kwargs["stage_ids"], level=kwargs["level"])

    async def wake_up(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(("wake_up", kwargs))
        if self.wake_error is not None:
            raise self.wake_error
        return self._acks(kwargs["stage_ids"])


class NoSleepEngine:
    """An engine client without sleep support at all."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []


class FakeEngine(SeedEngine):
    """The AsyncOmni control interface over ``num_stages`` stages, with its own truth.

    ``busy_stage``: sleeping it raises ``StageBusyError`` after the stages before it in the
    request have gone to sleep (a sleep that fails half-way).
    """

    def __init__(self, num_stages: int = 2, *, busy_stage: int | None = None, **options: Any):
        super().__init__(**options)
        self.num_stages = num_stages
        self.busy_stage = busy_stage
        self.asleep: set[int] = set()
        self.paused: set[int] = set()

    def _check(self, stage_ids: Iterable[int]) -> None:
        bad = [sid for sid in stage_ids if not 0 <= sid < self.num_stages]
        if bad:
            raise ValueError(
                f"unknown stage ids {bad}; valid stage ids are 0..{self.num_stages - 1}"
            )

    async def sleep(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(("sleep", kwargs))
        self._check(kwargs["stage_ids"])
        for sid in kwargs["stage_ids"]:
            if sid == self.busy_stage:
                raise StageBusyError(sid, "waking")
            if sid not in self.error_stages:
                self.asleep.add(sid)
        return self._acks(kwargs["stage_ids"], level=kwargs["level"])

    async def wake_up(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(("wake_up", kwargs))
        self._check(kwargs["stage_ids"])
        if self.wake_error is not None:
            raise self.wake_error
        if kwargs.get("tags") in (None, ["weights", "kv_cache"], ["kv_cache", "weights"]):
            self.asleep -= set(kwargs["stage_ids"]) - self.error_stages
        return self._acks(kwargs["stage_ids"])

    def sleeping_stage_ids(self) -> set[int]:
        return set(self.asleep)

    async def pause_generation(self, **kwargs: Any) -> None:
        self.calls.append(("pause_generation", kwargs))
        stage_ids = kwargs["stage_ids"]
        self.paused |= set(range(self.num_stages) if stage_ids is None else stage_ids)

    async def resume_generation(self, **kwargs: Any) -> None:
        self.calls.append(("resume_generation", kwargs))
        stage_ids = kwargs["stage_ids"]
        self.paused -= set(range(self.num_stages) if stage_ids is None else stage_ids)

    async def update_weights(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(("update_weights", kwargs))
        return [make_ack(kwargs["stage_id"]).to_dict()]

    async def stage_status(self) -> list[dict[str, Any]]:
        self.calls.append(("stage_status", {}))
        return [
            {
                "stage_id": sid,
                "kind": "ar" if sid == 0 else "diffusion",
                "state": "asleep" if sid in self.asleep else "awake",
                "paused": sid in self.paused,
            }
            for sid in range(self.num_stages)
        ]


def build_test_app(
    engine: Any,
    *,
    sleeping: Iterable[int] = (),
    api_key: str | None = None,
    control_api_key: str | None = None,
    extra_routers: Iterable[APIRouter] = (),
) -> FastAPI:
    """The control routers in a bare app, plus a data route and ``/health`` as the server has them."""
    app = FastAPI()
    register_exception_handlers(app)
    app.state.engine_client = engine
    app.state.sleeping_stages = set(sleeping)
    app.state.stage_states = stage_states(engine, app.state)
    app.state.api_key = api_key
    app.state.control_api_key = control_api_key

    data = APIRouter(dependencies=[Depends(require_api_key)])

    @data.post("/v1/chat/completions")
    async def chat() -> dict[str, str]:
        return {"object": "chat.completion"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(data)
    app.include_router(omni_control_router)
    app.include_router(vllm_compat.router)
    for router in extra_routers:
        app.include_router(router)
    return app


ClientFactory = Callable[..., TestClient]


@pytest.fixture
def client_for() -> ClientFactory:
    """``client_for(engine, sleeping=..., ...)``: a TestClient that answers 500s instead of raising."""

    def make(engine: Any, **options: Any) -> TestClient:
        return TestClient(build_test_app(engine, **options), raise_server_exceptions=False)

    return make


def recorded_sleeping(client: TestClient) -> set[int]:
    """The stages the app behind ``client`` knows to be sleeping: the seed's
    ``app.state.sleeping_stages``, as vLLM-Omni's route tests read it."""
    app = cast(FastAPI, client.app)
    sleeping: set[int] = app.state.sleeping_stages
    return set(sleeping)
