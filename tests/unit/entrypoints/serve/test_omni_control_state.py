"""The sleeping set follows what really happened: ERROR ACKs, partial wakes, engine truth."""

from __future__ import annotations

from tests.unit.entrypoints.serve.conftest import (
    ClientFactory,
    FakeEngine,
    SeedEngine,
    recorded_sleeping,
)


def test_error_ack_on_sleep_is_200_error_and_stage_not_recorded(client_for: ClientFactory) -> None:
    client = client_for(SeedEngine(error_stages={1}))
    reply = client.post("/v1/omni/sleep", json={"stage_ids": [0, 1]})
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "ERROR"
    assert "stage 1: out of host memory" in body["reason"]
    assert [ack["status"] for ack in body["acks"]] == ["SUCCESS", "ERROR"]
    assert recorded_sleeping(client) == {0}


def test_error_ack_on_wakeup_keeps_stage_recorded(client_for: ClientFactory) -> None:
    client = client_for(SeedEngine(error_stages={1}), sleeping={0, 1})
    reply = client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert reply.json()["status"] == "ERROR"
    assert recorded_sleeping(client) == {1}


def test_partial_tag_wake_keeps_stage_recorded_until_all_tags_wake(
    client_for: ClientFactory,
) -> None:
    engine = SeedEngine()
    client = client_for(engine, sleeping={0})
    client.post("/v1/omni/wakeup", json={"stage_ids": [0], "tags": ["weights"], "reload": False})
    assert recorded_sleeping(client) == {0}
    reply = client.post("/v1/omni/wakeup", json={"stage_ids": [0], "tags": ["kv_cache", "weights"]})
    assert reply.json()["status"] == "SUCCESS"
    assert recorded_sleeping(client) == set()
    assert len(engine.calls) == 2


def test_wakeup_consults_engine_truth_before_skipping(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    engine.asleep = {1}  # stage 1 went to sleep behind the HTTP layer's back
    client = client_for(engine, sleeping={0})  # stage 0 woke by itself (auto-wake)
    assert client.post("/v1/omni/wakeup", json={"stage_ids": [0]}).json()["status"] == "SKIPPED"
    assert engine.calls == []
    assert client.post("/v1/omni/wakeup", json={"stage_ids": [1]}).json()["status"] == "SUCCESS"
    assert recorded_sleeping(client) == set()


def test_sleep_failing_half_way_is_409_and_records_what_slept(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(busy_stage=1))
    reply = client.post("/v1/omni/sleep", json={"stage_ids": [0, 1]})
    assert reply.status_code == 409
    assert "stage 1 is busy" in reply.json()["detail"]
    assert recorded_sleeping(client) == {0}


def test_wake_error_with_engine_truth_keeps_stage_recorded(client_for: ClientFactory) -> None:
    engine = FakeEngine(wake_error=RuntimeError("rank 0 lost"))
    engine.asleep = {0}
    client = client_for(engine, sleeping={0})
    assert client.post("/v1/omni/wakeup", json={"stage_ids": [0]}).status_code == 500
    assert recorded_sleeping(client) == {0}


def test_stages_route_reports_engine_status_and_syncs_set(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    engine.asleep = {1}
    client = client_for(engine)
    reply = client.get("/v1/omni/stages")
    assert reply.status_code == 200
    assert [stage["state"] for stage in reply.json()["stages"]] == ["awake", "asleep"]
    assert recorded_sleeping(client) == {1}


def test_pause_without_body_pauses_every_stage_with_abort(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    reply = client_for(engine).post("/v1/omni/pause")
    assert reply.json() == {"status": "SUCCESS", "acks": []}
    assert engine.calls == [("pause_generation", {"stage_ids": None, "mode": "abort"})]


def test_pause_and_resume_named_stages(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    client = client_for(engine)
    client.post("/v1/omni/pause", json={"stage_ids": [1], "mode": "keep"})
    assert engine.paused == {1}
    client.post("/v1/omni/resume", json={"stage_ids": [1]})
    assert engine.paused == set()
    assert engine.calls[-1] == ("resume_generation", {"stage_ids": [1]})


def test_pause_unsupported_is_501(client_for: ClientFactory) -> None:
    reply = client_for(SeedEngine()).post("/v1/omni/pause", json={"mode": "wait"})
    assert reply.status_code == 501
    assert "pause_generation" in reply.json()["detail"]


def test_update_weights_forwards_stage_and_path(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    reply = client_for(engine).post(
        "/v1/omni/update_weights", json={"stage_id": 1, "path": "/ckpt/new.safetensors"}
    )
    assert reply.json()["status"] == "SUCCESS"
    assert reply.json()["acks"][0]["stage_id"] == 1
    assert engine.calls == [("update_weights", {"stage_id": 1, "path": "/ckpt/new.safetensors"})]


def test_update_weights_unknown_stage_is_400_naming_stage_id(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine()).post(
        "/v1/omni/update_weights", json={"stage_id": 4, "path": "/ckpt"}
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "stage_id"
