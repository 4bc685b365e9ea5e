"""vLLM-Omni's own route tests for ``/v1/omni/sleep`` and ``/v1/omni/wakeup``
(``tests/entrypoints/openai_api/test_omni_sleep_wakeup.py``), ported: the same apps, mock
engines and assertions, with omnistage's router (and, for the app-state case, its
``init_app_state``) where vLLM-Omni imports its own. They pin the seed's contract:
``app.state.sleeping_stages`` is the set the routes keep, preset by the caller, changed only
after the engine answered, and the engine is called with exactly vLLM-Omni's keywords.

Deliberate difference, tested elsewhere: vLLM-Omni answers a wakeup of stages that do not
sleep with SKIPPED before it checks that the engine can wake at all; omnistage checks first
(a wakeup on a server without sleep mode is 501, as SPEC's matrix says).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage.entrypoints.openai.api_server import init_app_state
from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.entrypoints.serve.omni_control.routes import router


@dataclasses.dataclass
class FakeAck:
    stage_id: int
    result: str = "ok"


def make_app(engine: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = engine
    app.state.sleeping_stages = set()
    return app


@pytest.fixture
def capable() -> MagicMock:
    engine = MagicMock()
    engine.sleep = AsyncMock(return_value=[FakeAck(0), FakeAck(1)])
    engine.wake_up = AsyncMock(return_value=[FakeAck(0), FakeAck(1)])
    return engine


@pytest.fixture
def incapable() -> MagicMock:
    return MagicMock(spec=[])


def test_sleep_success(capable: MagicMock) -> None:
    app = make_app(capable)
    reply = TestClient(app).post("/v1/omni/sleep", json={"stage_ids": [0, 1], "level": 2})
    assert reply.status_code == 200
    assert reply.json()["status"] == "SUCCESS"
    assert [ack["stage_id"] for ack in reply.json()["acks"]] == [0, 1]
    assert app.state.sleeping_stages == {0, 1}
    capable.sleep.assert_awaited_once_with(stage_ids=[0, 1], level=2)


def test_sleep_default_level(capable: MagicMock) -> None:
    reply = TestClient(make_app(capable)).post("/v1/omni/sleep", json={"stage_ids": [0]})
    assert reply.status_code == 200
    capable.sleep.assert_awaited_once_with(stage_ids=[0], level=2)


def test_sleep_empty_stage_ids(capable: MagicMock) -> None:
    capable.sleep = AsyncMock(return_value=[])
    app = make_app(capable)
    reply = TestClient(app).post("/v1/omni/sleep", json={"stage_ids": [], "level": 2})
    assert reply.status_code == 200
    assert reply.json()["status"] == "SUCCESS" and reply.json()["acks"] == []
    assert app.state.sleeping_stages == set()
    capable.sleep.assert_awaited_once_with(stage_ids=[], level=2)


def test_sleep_updates_sleeping_set(capable: MagicMock) -> None:
    app = make_app(capable)
    app.state.sleeping_stages = {5}
    TestClient(app).post("/v1/omni/sleep", json={"stage_ids": [0, 1], "level": 2})
    assert app.state.sleeping_stages == {5, 0, 1}


def test_sleep_engine_not_support(incapable: MagicMock) -> None:
    reply = TestClient(make_app(incapable)).post(
        "/v1/omni/sleep", json={"stage_ids": [0], "level": 1}
    )
    assert reply.status_code == 501 and "sleep" in reply.json()["detail"]


def test_wakeup_success(capable: MagicMock) -> None:
    app = make_app(capable)
    app.state.sleeping_stages = {0, 1}
    reply = TestClient(app).post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200 and reply.json()["status"] == "SUCCESS"
    assert [ack["stage_id"] for ack in reply.json()["acks"]] == [0, 1]
    assert app.state.sleeping_stages == set()
    capable.wake_up.assert_awaited_once_with(stage_ids=[0, 1])


def test_wakeup_skipped_when_not_sleeping(capable: MagicMock) -> None:
    reply = TestClient(make_app(capable)).post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200 and reply.json()["status"] == "SKIPPED"
    capable.wake_up.assert_not_awaited()


def test_wakeup_partial_sleeping(capable: MagicMock) -> None:
    app = make_app(capable)
    app.state.sleeping_stages = {0}
    reply = TestClient(app).post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200 and reply.json()["status"] == "SUCCESS"
    assert 0 not in app.state.sleeping_stages


def test_wakeup_empty_stage_ids(capable: MagicMock) -> None:
    app = make_app(capable)
    app.state.sleeping_stages = {0, 1}
    reply = TestClient(app).post("/v1/omni/wakeup", json={"stage_ids": []})
    assert reply.status_code == 200 and reply.json()["status"] == "SKIPPED"
    capable.wake_up.assert_not_awaited()


def test_wakeup_engine_not_support(incapable: MagicMock) -> None:
    app = make_app(incapable)
    app.state.sleeping_stages = {0}
    reply = TestClient(app).post("/v1/omni/wakeup", json={"stage_ids": [0]})
    assert reply.status_code == 501 and "wake_up" in reply.json()["detail"]


def test_wakeup_route_propagates_not_implemented_error(capable: MagicMock) -> None:
    capable.wake_up = AsyncMock(side_effect=NotImplementedError("engine wake_up refused"))
    app = make_app(capable)
    app.state.sleeping_stages = {0}
    with pytest.raises(NotImplementedError, match="engine wake_up refused"):
        TestClient(app, raise_server_exceptions=True).post(
            "/v1/omni/wakeup", json={"stage_ids": [0]}
        )
    assert app.state.sleeping_stages == {0}


def test_wakeup_removes_only_requested_stages(capable: MagicMock) -> None:
    app = make_app(capable)
    app.state.sleeping_stages = {0, 1, 2}
    TestClient(app).post("/v1/omni/wakeup", json={"stage_ids": [0]})
    assert app.state.sleeping_stages == {1, 2}


def test_sleep_then_wakeup_roundtrip(capable: MagicMock) -> None:
    app = make_app(capable)
    client = TestClient(app)
    assert client.post("/v1/omni/sleep", json={"stage_ids": [0, 1], "level": 2}).status_code == 200
    assert app.state.sleeping_stages == {0, 1}
    assert client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]}).status_code == 200
    assert app.state.sleeping_stages == set()


@pytest.fixture
def diffusion_engine() -> MagicMock:
    engine = MagicMock()
    engine.sleep = AsyncMock(return_value=[FakeAck(0)])
    engine.wake_up = AsyncMock(return_value=[FakeAck(0)])
    return engine


@pytest.fixture
def initialised_app(diffusion_engine: MagicMock) -> FastAPI:
    """An app whose state the server's own initialisation set (vLLM-Omni's
    ``omni_init_app_state``): it must start ``sleeping_stages`` empty."""
    app = FastAPI()
    app.include_router(router)
    init_app_state(diffusion_engine, app.state, ServerConfig(model="fake-diffusion-model"))
    return app


def test_initialised_sleep_success(initialised_app: FastAPI, diffusion_engine: MagicMock) -> None:
    reply = TestClient(initialised_app).post("/v1/omni/sleep", json={"stage_ids": [0], "level": 2})
    assert reply.status_code == 200 and reply.json()["status"] == "SUCCESS"
    assert initialised_app.state.sleeping_stages == {0}
    diffusion_engine.sleep.assert_awaited_once_with(stage_ids=[0], level=2)


def test_initialised_wakeup_skipped(initialised_app: FastAPI, diffusion_engine: MagicMock) -> None:
    reply = TestClient(initialised_app).post("/v1/omni/wakeup", json={"stage_ids": [0]})
    assert reply.status_code == 200 and reply.json()["status"] == "SKIPPED"
    diffusion_engine.wake_up.assert_not_awaited()


def test_initialised_sleep_then_wakeup(initialised_app: FastAPI) -> None:
    client = TestClient(initialised_app)
    assert client.post("/v1/omni/sleep", json={"stage_ids": [0], "level": 2}).status_code == 200
    assert initialised_app.state.sleeping_stages == {0}
    assert client.post("/v1/omni/wakeup", json={"stage_ids": [0]}).status_code == 200
    assert initialised_app.state.sleeping_stages == set()
