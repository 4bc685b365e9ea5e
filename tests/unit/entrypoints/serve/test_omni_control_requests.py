"""Request bodies of /v1/omni/*: bad input is a 400 naming the field; extension fields pass through."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.entrypoints.serve.conftest import ClientFactory, FakeEngine, SeedEngine

BAD_SLEEP_BODIES = [
    ({}, "stage_ids"),
    ({"stage_ids": None}, "stage_ids"),
    ({"stage_ids": 0}, "stage_ids"),
    ({"stage_ids": "0,1"}, "stage_ids"),
    ({"stage_ids": [True]}, "stage_ids"),
    ({"stage_ids": [-1]}, "stage_ids"),
    ({"stage_ids": [0], "level": "2"}, "level"),
    ({"stage_ids": [0], "level": 1.5}, "level"),
    ({"stage_ids": [0], "level": None}, "level"),
    ({"stage_ids": [0], "level": 3}, "level"),
    ({"stage_ids": [0], "level": -1}, "level"),
    ({"stage_ids": [0], "mode": "later"}, "mode"),
    ({"stage_ids": [0], "tags": ["optimizer"]}, "tags"),
    ({"stage_ids": [0], "tags": []}, "tags"),
]

BAD_WAKEUP_BODIES = [
    ({}, "stage_ids"),
    ({"stage_ids": None}, "stage_ids"),
    ({"stage_ids": [0], "tags": ["optimizer"]}, "tags"),
    ({"stage_ids": [0], "reload": "yes"}, "reload"),
    ({"stage_ids": [0], "resume": 1}, "resume"),
]


@pytest.mark.parametrize(("body", "field"), BAD_SLEEP_BODIES)
def test_bad_sleep_body_is_400_naming_the_field(
    client_for: ClientFactory, body: dict[str, Any], field: str
) -> None:
    engine = SeedEngine()
    reply = client_for(engine).post("/v1/omni/sleep", json=body)
    assert reply.status_code == 400
    assert f"body.{field}" in reply.json()["detail"]
    assert reply.json()["error"]["param"] == field
    assert engine.calls == []


@pytest.mark.parametrize(("body", "field"), BAD_WAKEUP_BODIES)
def test_bad_wakeup_body_is_400_naming_the_field(
    client_for: ClientFactory, body: dict[str, Any], field: str
) -> None:
    engine = SeedEngine()
    reply = client_for(engine, sleeping={0}).post("/v1/omni/wakeup", json=body)
    assert reply.status_code == 400
    assert f"body.{field}" in reply.json()["detail"]
    assert engine.calls == []


@pytest.mark.parametrize("content", ['{"stage_ids": [0', "[0, 1]", ""])
def test_malformed_json_or_non_object_body_is_400(client_for: ClientFactory, content: str) -> None:
    reply = client_for(SeedEngine()).post(
        "/v1/omni/sleep", content=content, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 400
    assert reply.json()["detail"].startswith("body")


def test_unknown_stage_id_is_400_naming_the_valid_range(client_for: ClientFactory) -> None:
    engine = FakeEngine(num_stages=2)
    reply = client_for(engine).post("/v1/omni/sleep", json={"stage_ids": [0, 5]})
    assert reply.status_code == 400
    assert "0..1" in reply.json()["detail"]
    assert reply.json()["error"]["param"] == "stage_ids"
    assert engine.calls == []


def test_unknown_stage_id_on_wakeup_is_400_not_skipped(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine(num_stages=2)).post("/v1/omni/wakeup", json={"stage_ids": [7]})
    assert reply.status_code == 400


def test_engine_value_error_for_unknown_stage_is_400(client_for: ClientFactory) -> None:
    engine = SeedEngine(sleep_error=ValueError("unknown stage ids [9]; valid stage ids are 0..1"))
    reply = client_for(engine).post("/v1/omni/sleep", json={"stage_ids": [9]})
    assert reply.status_code == 400
    assert "valid stage ids are 0..1" in reply.json()["detail"]


def test_unknown_body_keys_are_ignored(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    reply = client_for(engine).post(
        "/v1/omni/sleep", json={"stage_ids": [0], "level": 1, "priority": "high"}
    )
    assert reply.status_code == 200
    assert engine.calls == [("sleep", {"stage_ids": [0], "level": 1})]


def test_sleep_passes_mode_and_tags_when_sent(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client_for(engine).post(
        "/v1/omni/sleep", json={"stage_ids": [1], "level": 1, "mode": "keep", "tags": ["weights"]}
    )
    assert engine.calls == [
        ("sleep", {"stage_ids": [1], "level": 1, "mode": "keep", "tags": ["weights"]})
    ]


def test_wakeup_passes_tags_reload_and_resume_when_sent(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client_for(engine, sleeping={0}).post(
        "/v1/omni/wakeup",
        json={"stage_ids": [0], "tags": ["weights"], "reload": False, "resume": False},
    )
    assert engine.calls == [
        ("wake_up", {"stage_ids": [0], "tags": ["weights"], "reload": False, "resume": False})
    ]


@pytest.mark.parametrize(
    ("body", "field", "code"),
    [
        ({"level": 2}, "stage_ids", "missing"),
        ({"stage_ids": "not-a-list", "level": 2}, "stage_ids", "list_type"),
        # strict: "high" (or "2") is no integer here, where vLLM-Omni's lax int says int_parsing
        ({"stage_ids": [0], "level": "high"}, "level", "int_type"),
    ],
)
def test_validation_errors_carry_the_type_code_clients_look_for(
    client_for: ClientFactory, body: dict, field: str, code: str
) -> None:
    """vLLM-Omni's live tests (and FastAPI clients) match pydantic's type codes."""
    reply = client_for(FakeEngine()).post("/v1/omni/sleep", json=body)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert field in message and f"[type={code}]" in message
