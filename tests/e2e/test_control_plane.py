"""SPEC §5 matrix and the control routes against a real server."""

import httpx
import pytest


def post(server, path, body, headers=None):
    return httpx.post(
        server.url + path,
        json=body,
        headers=server.control_headers() if headers is None else headers,
        timeout=120,
    )


def test_sleep_default_level_records_both_and_wakeup_empties(omni_server):
    r = post(omni_server, "/v1/omni/sleep", {"stage_ids": [0, 1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "SUCCESS" and [a["stage_id"] for a in body["acks"]] == [0, 1]
    assert all(a["metadata"]["level"] == 2 for a in body["acks"])
    assert all(a["freed_bytes"] > 0 for a in body["acks"])
    stages = httpx.get(
        omni_server.url + "/v1/omni/stages", headers=omni_server.control_headers()
    ).json()
    assert [s["state"] for s in stages["stages"]] == ["asleep", "asleep"]
    r = post(omni_server, "/v1/omni/wakeup", {"stage_ids": [0, 1]})
    assert r.json()["status"] == "SUCCESS"
    r = post(omni_server, "/v1/omni/wakeup", {"stage_ids": [0, 1]})
    body = r.json()
    assert (body["status"], body["reason"]) == ("SKIPPED", "Target stages are not sleeping.")
    assert [(a["stage_id"], a["status"]) for a in body["acks"]] == [(0, "SKIPPED"), (1, "SKIPPED")]


def test_a_repeated_sleep_and_a_repeated_wake_answer_alike(omni_server):
    """Nothing to change: SKIPPED, a reason, one SKIPPED ACK per stage — either way."""
    answers = []
    for path, body in [
        ("/v1/omni/sleep", {"stage_ids": [0, 1], "level": 1}),
        ("/v1/omni/sleep", {"stage_ids": [0, 1], "level": 1}),
        ("/v1/omni/wakeup", {"stage_ids": [0, 1]}),
        ("/v1/omni/wakeup", {"stage_ids": [0, 1]}),
    ]:
        r = post(omni_server, path, body)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    first_sleep, second_sleep, first_wake, second_wake = answers
    assert first_sleep["status"] == first_wake["status"] == "SUCCESS"
    assert second_sleep["reason"] == "Target stages are already sleeping."
    assert second_wake["reason"] == "Target stages are not sleeping."
    for repeated in (second_sleep, second_wake):
        assert set(repeated) == {"status", "reason", "acks"} and repeated["status"] == "SKIPPED"
        assert [(a["stage_id"], a["status"]) for a in repeated["acks"]] == [
            (0, "SKIPPED"),
            (1, "SKIPPED"),
        ]


def test_a_request_for_sleeping_stages_names_every_one_with_retry_after(omni_server):
    assert post(omni_server, "/v1/omni/sleep", {"stage_ids": [0, 1], "level": 1}).status_code == 200
    try:
        r = httpx.post(
            omni_server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "draw"}],
                "modalities": ["text", "image"],
            },
            headers=omni_server.data_headers(),
            timeout=60,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "stage_asleep"
        assert "stages [0, 1] are asleep" in r.json()["detail"]
        assert r.headers["Retry-After"] == "1"  # SPEC: every sleeping-stage 503 carries it
    finally:
        post(omni_server, "/v1/omni/wakeup", {"stage_ids": [0, 1]})


def test_sleep_empty_and_wakeup_empty(omni_server):
    r = post(omni_server, "/v1/omni/sleep", {"stage_ids": [], "level": 2})
    assert r.status_code == 200 and r.json()["acks"] == []
    r = post(omni_server, "/v1/omni/wakeup", {"stage_ids": []})
    assert r.json()["status"] == "SKIPPED"


def test_wakeup_partly_sleeping_removes_only_the_sleeper(omni_server):
    assert post(omni_server, "/v1/omni/sleep", {"stage_ids": [0], "level": 1}).status_code == 200
    r = post(omni_server, "/v1/omni/wakeup", {"stage_ids": [0, 1]})
    assert r.status_code == 200 and r.json()["status"] == "SUCCESS"
    assert (
        httpx.get(omni_server.url + "/is_sleeping", headers=omni_server.control_headers()).json()[
            "is_sleeping"
        ]
        is False
    )


def test_unsupported_sleep_and_wakeup_are_501(plain_server):
    r = post(plain_server, "/v1/omni/sleep", {"stage_ids": [0]})
    assert r.status_code == 501 and "sleep" in r.text
    r = post(plain_server, "/v1/omni/wakeup", {"stage_ids": [0]})
    assert r.status_code == 501 and "wake_up" in r.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "stage_ids"),
        ({"stage_ids": None}, "stage_ids"),
        ({"stage_ids": 0}, "stage_ids"),
        ({"stage_ids": [0], "level": "deep"}, "level"),
        ({"stage_ids": [0], "level": 9}, "level"),
        ({"stage_ids": [0], "mode": "later"}, "mode"),
        ({"stage_ids": [0], "tags": ["activations"]}, "tags"),
        ({"stage_ids": [7]}, "0..1"),
    ],
)
def test_bad_sleep_bodies_name_the_field(omni_server, body, field):
    r = post(omni_server, "/v1/omni/sleep", body)
    assert r.status_code in (400, 422), r.text
    assert field in r.text


def test_control_key_guards_control_routes_only(omni_server):
    assert post(omni_server, "/v1/omni/sleep", {"stage_ids": []}, headers={}).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert post(omni_server, "/v1/omni/sleep", {"stage_ids": []}, headers=bad).status_code == 401
    assert httpx.get(omni_server.url + "/v1/omni/stages", headers=bad).status_code == 401
    assert httpx.get(omni_server.url + "/v1/models").status_code == 200
    assert httpx.get(omni_server.url + "/health").status_code == 200


def test_vllm_sleep_family(omni_server):
    h = omni_server.control_headers()
    r = httpx.post(omni_server.url + "/sleep", params={"level": 1}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(omni_server.url + "/is_sleeping", headers=h).json()["is_sleeping"] is True
    r = httpx.post(omni_server.url + "/wake_up", headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(omni_server.url + "/is_sleeping", headers=h).json()["is_sleeping"] is False
    assert httpx.get(omni_server.url + "/is_paused", headers=h).json()["is_paused"] is False
