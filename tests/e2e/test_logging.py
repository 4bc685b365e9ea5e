"""Operator logs of a real server (``--log-format json``): one line per control event with its
fields — idle sleep, auto-wake, sleep and wake from the API, a stage's death and return — from
the server and uvicorn alike, and stage processes with readable names in ``ps``.

One server for the module; every stage idles into sleep after ``IDLE_S`` seconds, which the
tests use (the image decoder is never asked for, so it stays parked once idle)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time
from typing import Any

import httpx
import pytest

from tests.e2e.server import running_server

IDLE_S = 3
CHAT = {
    "messages": [{"role": "user", "content": "Hello"}],
    "modalities": ["text"],  # the image decoder is never asked for
    "max_tokens": 4,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--pipeline",
        "tiny-omni",
        "--enable-sleep-mode",
        "--auto-wake",
        "--idle-sleep-s",
        str(IDLE_S),
        "--log-format",
        "json",
    ) as server:
        yield server


def records(server) -> list[dict[str, Any]]:
    out = []
    for line in list(server.log):
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def find(server, event: str, **match: Any) -> list[dict[str, Any]]:
    return [
        r
        for r in records(server)
        if r.get("event") == event and all(r.get(k) == v for k, v in match.items())
    ]


def wait_for(server, event: str, timeout_s: float = 30, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (found := find(server, event, **match)):
        assert time.monotonic() < deadline, f"no {event} {match} log line:\n{''.join(server.log)}"
        time.sleep(0.05)
    return found[-1]


def stages(server) -> list[dict[str, Any]]:
    return httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"]


def control(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat(server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text


def assert_titled(pid: int, stage_id: int, name: str) -> None:
    with open(f"/proc/{pid}/comm") as f:
        assert f.read().strip() == f"stage{stage_id}-{name}"[:15]
    if importlib.util.find_spec("setproctitle") is not None:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode().strip()
        assert cmdline == f"omnistage-stage{stage_id}-{name}"


def test_stage_processes_have_readable_titles(server):
    for s in stages(server):
        assert_titled(s["pid"], s["stage_id"], s["name"])
    assert [s["name"] for s in stages(server)] == ["thinker", "image-decoder"]


def test_an_idle_stage_is_parked_with_a_log_line(server):
    idle = wait_for(server, "idle_sleep", stage_id=1)
    assert idle["stage"] == "image-decoder" and idle["level"] == "INFO"
    assert idle["idle_s"] >= IDLE_S and idle["sleep_level"] == 1
    slept = wait_for(server, "sleep", stage_id=1, trigger="idle_sleep")
    assert slept["status"] == "SUCCESS" and slept["sleep_level"] == 1 and slept["mode"] == "wait"
    assert slept["logger"] == "omnistage.engine.control" and slept["stage"] == "image-decoder"
    assert isinstance(slept["freed_bytes"], int) and slept["latency_ms"] > 0
    assert set(slept["tags"]) == {"weights"}  # a diffusion stage has no KV cache


def test_a_request_for_a_parked_stage_wakes_it_with_log_lines(server):
    wait_for(server, "sleep", stage_id=0, trigger="idle_sleep")
    chat(server)
    assert wait_for(server, "auto_wake", stage_id=0)["stage"] == "thinker"
    woke = wait_for(server, "wake", stage_id=0, trigger="auto_wake")
    assert woke["status"] == "SUCCESS" and woke["sleep_level"] == 1
    assert woke["latency_ms"] > 0 and woke["restored_bytes"] > 0
    assert woke["message"] == "stage 0 (thinker) is awake (from level 1)"


def test_sleep_and_wake_from_the_api_are_logged_with_their_ack(server):
    chat(server)  # awake, and not idle for IDLE_S
    (ack,) = control(server, "/v1/omni/sleep", {"stage_ids": [0], "level": 2})["acks"]
    line = wait_for(server, "sleep", stage_id=0, trigger="api")
    assert line["status"] == "SUCCESS" and line["sleep_level"] == 2 and line["mode"] == "abort"
    assert line["freed_bytes"] == ack["freed_bytes"] > 0
    assert line["latency_ms"] == round(ack["metadata"]["latency_ms"], 3)
    assert set(line["tags"]) == {"weights", "kv_cache"}
    control(server, "/v1/omni/wakeup", {"stage_ids": [0]})
    line = wait_for(server, "wake", stage_id=0, trigger="api")
    assert line["status"] == "SUCCESS" and line["sleep_level"] == 2 and line["reload"] is True


def test_a_killed_stage_is_logged_dying_and_coming_back(server):
    before = stages(server)[1]
    assert before["state"] == "asleep"  # parked since the idle test: it comes back asleep
    os.kill(before["pid"], signal.SIGKILL)
    back = wait_for(server, "stage_restarted", timeout_s=60, stage_id=1)
    died = wait_for(server, "stage_died", stage_id=1)
    assert died["level"] == "ERROR" and died["pid"] == before["pid"]
    assert died["signal"] == "SIGKILL" and died["exit_code"] == -signal.SIGKILL
    assert died["will_restart"] is True and died["restarts"] == 0
    assert died["comes_back"] == "asleep at level 1"
    assert wait_for(server, "stage_restarting", stage_id=1)["attempt"] == 1
    assert back["restarts"] == 1 and back["pid"] != before["pid"] and back["sleep_level"] == 1
    assert back["down_ms"] >= back["startup_ms"] > 0
    assert_titled(back["pid"], 1, "image-decoder")


def test_every_log_line_is_json_uvicorns_included(server):
    text_line = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} )?(DEBUG|INFO|WARNING|ERROR)")
    assert not [line for line in server.log if text_line.match(line)]
    loggers = {r["logger"] for r in records(server)}
    assert {"uvicorn.error", "uvicorn.access", "omnistage.engine.control"} <= loggers
    for r in records(server):
        assert r["time"].endswith("+00:00") and r["level"] in {"INFO", "WARNING", "ERROR"}


def test_each_request_logs_its_arrival_and_end_with_its_id(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]
    received = wait_for(server, "request_received", request_id=request_id)
    finished = wait_for(server, "request_finished", request_id=request_id)
    assert received["route"] == "chat" and received["logger"] == "omnistage.requests"
    assert finished["finish_reason"] in ("stop", "length") and finished["latency_ms"] > 0
    assert finished["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert "Hello" not in json.dumps([received, finished])  # prompts are never logged


def test_disable_log_requests_silences_request_lines_but_not_control_events():
    with running_server(
        "--pipeline",
        "tiny-chat",
        "--enable-sleep-mode",
        "--disable-log-requests",
        "--log-format",
        "json",
    ) as quiet:
        chat(quiet)
        control(quiet, "/v1/omni/sleep", {"stage_ids": [0], "level": 1})
        wait_for(quiet, "sleep", stage_id=0)
        assert not find(quiet, "request_received") and not find(quiet, "request_finished")
        assert not any('"logger": "uvicorn.access"' in line for line in quiet.log)
