"""Stage replicas over HTTP (``omnistage serve --pipeline tiny-omni --stage-replicas
image-decoder=2``): ``/v1/omni/stages`` lists each replica; ``/v1/omni/sleep`` and
``/v1/omni/wakeup`` with ``replica_ids`` answer one ACK per replica named by ``replica_id``
while the stage serves on; ``omnistage ctl`` shows and drives them; ``/metrics`` has a
``replica`` label; a trainer's weight sync (gloo, shared memory) reaches both thinker
replicas, each then holding the trainer's checksum; a replica id the stage lacks is a 400
naming ``replica_ids``; a bad ``--stage-replicas`` stops the server at start naming the
flag."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import running_server


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--pipeline", "tiny-omni", "--enable-sleep-mode",
        "--stage-replicas", "image-decoder=2", "thinker=2",
    ) as server:  # fmt: skip
        yield server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def stages(server) -> list[dict]:
    return httpx.get(server.url + "/v1/omni/stages", timeout=60).json()["stages"]


def draw(server) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": "draw"}],
        "modalities": ["text", "image"],
        "max_tokens": 4,
        "num_inference_steps": 2,
    }
    return post(server, "/v1/chat/completions", body)


def ctl(server, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "ctl", *args, "--url", server.url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_stages_list_each_replica(server):
    thinker, image = stages(server)
    assert [r["replica_id"] for r in thinker["replicas"]] == [0, 1]
    assert [(r["replica_id"], r["state"]) for r in image["replicas"]] == [
        (0, "awake"),
        (1, "awake"),
    ]
    assert len({r["pid"] for r in image["replicas"]}) == 2
    assert all(r["memory"]["resident_bytes"] > 0 for r in image["replicas"])


def test_one_replica_sleeps_and_wakes_over_http_while_the_stage_serves(server):
    reply = post(server, "/v1/omni/sleep", {"stage_ids": [1], "level": 2, "replica_ids": [1]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "SUCCESS"
    assert [(a["stage_id"], a["replica_id"]) for a in body["acks"]] == [(1, 1)]
    image = stages(server)[1]
    assert image["state"] == "awake"
    assert [r["state"] for r in image["replicas"]] == ["awake", "asleep"]
    assert image["replicas"][1]["memory"]["released_bytes"] > 0
    assert draw(server).status_code == 200
    out = ctl(server, "status")
    assert "1.0" in out and "1.1" in out and "asleep" in out
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    documented = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    families = re.findall(r"^\| `(omnistage:replica_[a-z_]+)` \|", documented, flags=re.M)
    assert len(families) >= 5
    for family in families:  # each documented replica family has samples here
        assert re.search(rf"^{family}\{{", metrics, flags=re.M), family
    assert re.search(r'omnistage:replica_state\{[^}]*replica="1",stage="1",state="asleep"\} 1\.0',
                     metrics), metrics  # fmt: skip
    assert "status: SUCCESS" in ctl(server, "wakeup", "1", "--replica-ids", "1")
    assert [r["state"] for r in stages(server)[1]["replicas"]] == ["awake", "awake"]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_trainers_sync_reaches_every_replica(server, backend):
    from omnistage.pipelines import load_pipeline

    folder = load_pipeline("tiny-omni").stages[0].model
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.trainer", server.url, folder, backend, "ok", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (step,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert (step["status"], step["checksum_ok"]) == ("SUCCESS", True), step  # every replica's
    assert httpx.get(server.url + "/get_world_size", timeout=30).json() == {"world_size": 2}
    assert draw(server).status_code == 200


def test_a_replica_id_the_stage_lacks_is_named(server):
    reply = post(server, "/v1/omni/sleep", {"stage_ids": [1], "replica_ids": [2]})
    assert reply.status_code == 400 and "replica_ids" in reply.text
    reply = post(server, "/v1/omni/sleep", {"stage_ids": [1], "replica_ids": []})
    assert reply.status_code == 400 and "replica_ids" in reply.text
    assert [r["state"] for r in stages(server)[1]["replicas"]] == ["awake", "awake"]


def test_a_bad_stage_replicas_flag_stops_the_server_naming_it():
    done = subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "serve", "--pipeline", "tiny-omni",
         "--stage-replicas", "painter=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "--stage-replicas" in done.stdout + done.stderr
