"""``omnistage serve --model DIR --tensor-parallel-size 2`` over HTTP: chat works, and the
sleep and wake replies carry one ACK per rank (vLLM-Omni's shape); shutdown leaves no rank
process behind."""

from __future__ import annotations

import json
import time

import httpx
import psutil

from tests.e2e.server import running_server
from tests.unit.models.hf_checkpoints import build_checkpoint


def test_serve_with_two_ranks(tmp_path):
    _, folder = build_checkpoint("qwen2-tied", tmp_path / "qwen2")
    args = ["--model", str(folder), "-tp", "2", "--enable-sleep-mode", "--max-model-len", "128"]
    with running_server(*args) as server:
        pids = server.stage_pids()
        assert len(pids) >= 2  # the stage process (rank 0) and rank 1
        with httpx.Client(base_url=server.url, timeout=60) as client:
            chat = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "temperature": 0,
            }
            first = client.post("/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            slept = client.post("/v1/omni/sleep", json={"stage_ids": [0], "level": 2})
            assert slept.status_code == 200, slept.text
            acks = slept.json()["acks"]
            assert [(a["stage_id"], a["rank"], a["status"]) for a in acks] == [
                (0, 0, "SUCCESS"),
                (0, 1, "SUCCESS"),
            ]
            assert all("rank_acks" not in a for a in acks), acks
            assert all(a["freed_bytes"] > 0 for a in acks), [a["freed_bytes"] for a in acks]
            woke = client.post("/v1/omni/wakeup", json={"stage_ids": [0]})
            assert [a["rank"] for a in woke.json()["acks"]] == [0, 1]
            again = client.post("/v1/chat/completions", json=chat)
            assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
            stages = client.get("/v1/omni/stages").json()
            assert '"tensor_parallel_size": 2' in json.dumps(stages), stages
    deadline = time.monotonic() + 15  # rank 1 goes with its stage (PDEATHSIG), a moment later
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.1)
    assert not alive(pids)


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living
