"""vLLM's sleep API over every stage, with the /v1/omni/* bookkeeping."""

from __future__ import annotations

from tests.unit.entrypoints.serve.conftest import ClientFactory, FakeEngine, recorded_sleeping


def test_sleep_defaults_to_level_1_abort_on_every_stage(client_for: ClientFactory) -> None:
    engine = FakeEngine(num_stages=3)
    client = client_for(engine)
    reply = client.post("/sleep")
    assert reply.status_code == 200
    assert engine.calls == [("sleep", {"stage_ids": [0, 1, 2], "level": 1, "mode": "abort"})]
    assert recorded_sleeping(client) == {0, 1, 2}


def test_sleep_takes_level_and_mode_from_the_query(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    client_for(engine).post("/sleep?level=2&mode=keep")
    assert engine.calls == [("sleep", {"stage_ids": [0, 1], "level": 2, "mode": "keep"})]


def test_sleep_bad_level_is_400_naming_it(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine()).post("/sleep?level=5")
    assert reply.status_code == 400
    assert "query.level" in reply.json()["detail"]


def test_wake_up_with_nothing_asleep_is_skipped(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    assert client_for(engine).post("/wake_up").json()["status"] == "SKIPPED"
    assert engine.calls == []


def test_wake_up_wakes_the_sleeping_stages_with_repeated_tags(client_for: ClientFactory) -> None:
    engine = FakeEngine(num_stages=3)
    engine.asleep = {0, 2}
    client = client_for(engine, sleeping={0, 2})
    reply = client.post("/wake_up?tags=weights&tags=kv_cache")
    assert reply.json()["status"] == "SUCCESS"
    assert engine.calls == [("wake_up", {"stage_ids": [0, 2], "tags": ["weights", "kv_cache"]})]
    assert recorded_sleeping(client) == set()


def test_wake_up_weights_only_keeps_stages_sleeping(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    engine.asleep = {0, 1}
    client = client_for(engine, sleeping={0, 1})
    client.post("/wake_up?tags=weights&reload=false")
    assert engine.calls[-1] == (
        "wake_up",
        {"stage_ids": [0, 1], "tags": ["weights"], "reload": False},
    )
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}


def test_wake_up_unknown_tag_is_400(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine(), sleeping={0}).post("/wake_up?tags=optimizer")
    assert reply.status_code == 400
    assert "query.tags" in reply.json()["detail"]


def test_is_sleeping_follows_sleep_and_wake(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine())
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    client.post("/sleep")
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    client.post("/wake_up")
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_pause_resume_and_is_paused(client_for: ClientFactory) -> None:
    engine = FakeEngine()
    client = client_for(engine)
    client.post("/pause?mode=keep")
    assert engine.calls[-1] == ("pause_generation", {"stage_ids": None, "mode": "keep"})
    assert client.get("/is_paused").json() == {"is_paused": True}
    client.post("/resume")
    assert client.get("/is_paused").json() == {"is_paused": False}
