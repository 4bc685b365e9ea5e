"""omnistage's exceptions become JSON replies with the right status, code and headers."""

from __future__ import annotations

import pytest
from fastapi import APIRouter
from pydantic import BaseModel, model_validator

from omnistage.entrypoints.openai.protocol import field_error
from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    StageBusyError,
    StageDeadError,
    StagePausedError,
    StageRestartingError,
    WeightsInvalidError,
)
from tests.unit.entrypoints.serve.conftest import ClientFactory, FakeEngine, SeedEngine

RAISED = {
    "asleep": StageAsleepError(1),
    "asleep-auto-wake": StageAsleepError([0, 1], retry_after=True),
    "restarting": StageRestartingError(1, "exit code -9"),
    "paused": StagePausedError(1),
    "dead": StageDeadError(1, "exit code -9"),
    "weights": WeightsInvalidError(0),
    "busy": StageBusyError(1, "sleeping"),
    "disabled": SleepModeDisabledError(0),
    "invalid": InvalidRequestError("max_tokens", "must be positive"),
    "timeout": TimeoutError("drain did not finish; raise drain_timeout_s"),
    "bug": KeyError("oops"),
}


def _raising_router() -> APIRouter:
    router = APIRouter()

    @router.get("/raise/{name}")
    async def raise_named(name: str) -> None:
        raise RAISED[name]

    return router


@pytest.mark.parametrize(
    ("name", "status", "code", "retry_after"),
    [
        # Retry-After on every 503 for a stage that is asleep, paused or restarting (SPEC).
        ("asleep", 503, "stage_asleep", True),
        ("asleep-auto-wake", 503, "stage_asleep", True),
        ("restarting", 503, "stage_restarting", True),
        ("paused", 503, "stage_paused", True),
        ("dead", 503, "stage_dead", False),
        ("weights", 503, "weights_invalid", False),
        ("busy", 409, "stage_busy", False),
        ("disabled", 501, "sleep_mode_disabled", False),
        ("invalid", 400, "invalid_request", False),
        ("timeout", 504, "timeout", False),
        ("bug", 500, "internal_error", False),
    ],
)
def test_exception_maps_to_status_code_and_retry_after(
    client_for: ClientFactory, name: str, status: int, code: str, retry_after: bool
) -> None:
    client = client_for(FakeEngine(), extra_routers=[_raising_router()])
    reply = client.get(f"/raise/{name}")
    assert reply.status_code == status
    assert reply.json()["error"]["code"] == code
    assert reply.json()["detail"] == reply.json()["error"]["message"]
    assert ("Retry-After" in reply.headers) is retry_after


def test_asleep_reply_names_the_stage(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine(), extra_routers=[_raising_router()]).get("/raise/asleep")
    assert "stage 1 is asleep" in reply.json()["detail"]


def test_asleep_reply_names_every_sleeping_stage(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), extra_routers=[_raising_router()])
    detail = client.get("/raise/asleep-auto-wake").json()["detail"]
    assert "stages [0, 1] are asleep" in detail and '{"stage_ids": [0, 1]}' in detail


def test_invalid_request_names_the_param(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine(), extra_routers=[_raising_router()]).get("/raise/invalid")
    assert reply.json()["error"]["param"] == "max_tokens"


class _Inner(BaseModel):
    a: int = 0
    b: int = 0

    @model_validator(mode="after")
    def _agree(self) -> _Inner:
        if self.a != self.b:
            raise field_error("b", "differs from a; give one")
        return self


class _Outer(BaseModel):
    items: list[_Inner]


def test_a_check_across_fields_names_the_field_at_fault(client_for: ClientFactory) -> None:
    """A model validator's error has no field of its own (``param`` was null); one raised
    with ``field_error`` names its field, under the error's location in the body."""
    router = APIRouter()

    @router.post("/check")
    async def check(body: _Outer) -> None:
        return None

    client = client_for(FakeEngine(), extra_routers=[router])
    reply = client.post("/check", json={"items": [{"a": 1, "b": 1}, {"a": 1, "b": 2}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "items.1.b", error
    assert error["message"].startswith("items.1.b: differs from a; give one"), error


def test_engine_sleep_mode_disabled_detail_names_sleep_and_wake_up(
    client_for: ClientFactory,
) -> None:
    reply = client_for(SeedEngine(sleep_error=SleepModeDisabledError(0))).post(
        "/v1/omni/sleep", json={"stage_ids": [0]}
    )
    assert reply.status_code == 501
    assert "sleep" in reply.json()["detail"]
    assert "wake_up" in reply.json()["detail"]


def test_engine_declaring_sleep_mode_disabled_is_501_even_with_nothing_asleep(
    client_for: ClientFactory,
) -> None:
    engine = FakeEngine()
    engine.sleep_mode_enabled = False  # type: ignore[attr-defined]
    reply = client_for(engine).post("/v1/omni/wakeup", json={"stage_ids": []})
    assert reply.status_code == 501
    assert "wake_up" in reply.json()["detail"]


def test_unknown_route_is_a_json_404(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine()).get("/v1/omni/nothing")
    assert reply.status_code == 404
    assert reply.json()["detail"] == "Not Found"
