"""SPEC §5: the seed's behaviour matrix for /v1/omni/sleep and /v1/omni/wakeup, row by row.

Run against an engine client with only vLLM-Omni's interface, so the routes' exact engine calls
and bookkeeping are the seed's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.entrypoints.serve.conftest import (
    ClientFactory,
    NoSleepEngine,
    SeedEngine,
    recorded_sleeping,
)

SKIPPED = {"status": "SKIPPED", "reason": "Target stages are not sleeping."}


def assert_skipped(reply: Any, stage_ids: list[int]) -> None:
    """vLLM-Omni's SKIPPED body, with one SKIPPED ACK per stage (the shape of every answer)."""
    body = reply.json()
    assert reply.status_code == 200
    assert {k: body[k] for k in ("status", "reason")} == SKIPPED
    assert [(a["stage_id"], a["status"]) for a in body["acks"]] == [
        (sid, "SKIPPED") for sid in stage_ids
    ]


def test_sleep_default_level_acks_each_stage_and_records_both(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client = client_for(engine)
    reply = client.post("/v1/omni/sleep", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "SUCCESS"
    assert [ack["stage_id"] for ack in body["acks"]] == [0, 1]
    assert recorded_sleeping(client) == {0, 1}
    assert engine.calls == [("sleep", {"stage_ids": [0, 1], "level": 2})]


def test_sleep_reply_is_exactly_status_and_acks(client_for: ClientFactory) -> None:
    reply = client_for(SeedEngine()).post("/v1/omni/sleep", json={"stage_ids": [0]})
    assert set(reply.json()) == {"status", "acks"}
    assert set(reply.json()["acks"][0]) == {
        "task_id", "status", "stage_id", "rank", "freed_bytes", "error_msg", "metadata",
    }  # fmt: skip


def test_sleep_empty_calls_engine_and_records_nothing(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client = client_for(engine)
    reply = client.post("/v1/omni/sleep", json={"stage_ids": [], "level": 2})
    assert reply.status_code == 200
    assert reply.json() == {"status": "SUCCESS", "acks": []}
    assert engine.calls == [("sleep", {"stage_ids": [], "level": 2})]
    assert recorded_sleeping(client) == set()


@pytest.mark.parametrize("body", [{"stage_ids": [0, 1]}, {"stage_ids": [], "level": 1}])
def test_sleep_unsupported_is_501_mentioning_sleep(client_for: ClientFactory, body: dict) -> None:
    reply = client_for(NoSleepEngine()).post("/v1/omni/sleep", json=body)
    assert reply.status_code == 501
    assert "sleep" in reply.json()["detail"]


def test_wakeup_empties_sleeping_set(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client = client_for(engine, sleeping={0, 1})
    reply = client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200
    assert reply.json()["status"] == "SUCCESS"
    assert recorded_sleeping(client) == set()
    assert engine.calls == [("wake_up", {"stage_ids": [0, 1]})]


@pytest.mark.parametrize("body", [{"stage_ids": [0, 1]}, {"stage_ids": [1], "tags": ["weights"]}])
def test_wakeup_none_sleeping_is_skipped_without_engine_call(
    client_for: ClientFactory, body: dict
) -> None:
    engine = SeedEngine()
    reply = client_for(engine).post("/v1/omni/wakeup", json=body)
    assert_skipped(reply, body["stage_ids"])
    assert engine.calls == []


def test_wakeup_partly_sleeping_removes_only_the_sleeper(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    client = client_for(engine, sleeping={0, 7})
    reply = client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.json()["status"] == "SUCCESS"
    assert recorded_sleeping(client) == {7}
    assert engine.calls == [("wake_up", {"stage_ids": [0, 1]})]


def test_wakeup_empty_is_skipped_without_engine_call(client_for: ClientFactory) -> None:
    engine = SeedEngine()
    reply = client_for(engine, sleeping={0}).post("/v1/omni/wakeup", json={"stage_ids": []})
    assert_skipped(reply, [])
    assert engine.calls == []


@pytest.mark.parametrize("sleeping", [set(), {0}])
def test_wakeup_unsupported_is_501_mentioning_wake_up(
    client_for: ClientFactory, sleeping: set[int]
) -> None:
    reply = client_for(NoSleepEngine(), sleeping=sleeping).post(
        "/v1/omni/wakeup", json={"stage_ids": [0]}
    )
    assert reply.status_code == 501
    assert "wake_up" in reply.json()["detail"]


@pytest.mark.parametrize(
    "error", [RuntimeError("wake failed on rank 0"), NotImplementedError("level-2 reload")]
)
def test_wakeup_engine_error_surfaces_and_stage_stays_sleeping(
    client_for: ClientFactory, error: Exception
) -> None:
    client = client_for(SeedEngine(wake_error=error), sleeping={0})
    reply = client.post("/v1/omni/wakeup", json={"stage_ids": [0]})
    assert reply.status_code == 500
    assert str(error) in reply.json()["detail"]
    assert recorded_sleeping(client) == {0}
