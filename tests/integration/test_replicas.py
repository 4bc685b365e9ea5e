"""Stage replicas in real processes: tiny-omni with its thinker and its image decoder each run
as two processes. Requests spread over both and answer as they do alone; a request whose
prompt starts as an earlier one's goes to the thinker replica that cached it; one replica
sleeps (its memory given back) while the stage serves on the other, and a sleep of the last
serving replica, or of the stage, puts the stage to sleep; a killed replica comes back while
the other serves; a checkpoint update reaches both; a tensor-parallel stage runs its ranks
inside each replica."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio

from omnistage.engine.async_omni import AsyncOmni
from omnistage.engine.supervisor import RestartPolicy
from omnistage.entrypoints.openai.server_config import with_replicas
from omnistage.errors import StageAsleepError
from omnistage.pipelines import load_pipeline
from tests.integration.helpers import collect, until

FAST = RestartPolicy(max_restarts=20, window_s=600, backoff_s=0.05, max_backoff_s=0.2)
IMAGE = ["text", "image"]


@pytest_asyncio.fixture(scope="module")
async def omni():
    config = with_replicas(
        load_pipeline("tiny-omni", enable_sleep_mode=True, torch_threads=1), ["0=2", "1=2"]
    )
    engine = AsyncOmni.from_config(config, restart_policy=FAST, resume_after_wake=True)
    try:
        yield engine
    finally:
        engine.shutdown()


async def replicas(omni: AsyncOmni, stage_id: int) -> list[dict]:
    return (await omni.stage_status())[stage_id]["replicas"]


async def test_requests_spread_over_the_replicas_and_answer_as_alone(omni):
    prompts = [f"a picture of {thing}" for thing in ("a cat", "the sea", "a tree", "two dogs")]
    alone = [await collect(omni, p, IMAGE) for p in prompts]
    together = await asyncio.gather(*(collect(omni, p, IMAGE, request_id=f"spread-{i}")
                                      for i, p in enumerate(prompts)))  # fmt: skip
    assert [(r.text, r.pngs) for r in together] == [(r.text, r.pngs) for r in alone]
    placed = {omni.clients[1].placed(f"spread-{i}") for i in range(4)}
    assert placed == {0, 1}, placed  # four at once: both image replicas took some
    status = await omni.stage_status()
    assert [r["state"] for r in status[1]["replicas"]] == ["awake", "awake"]
    assert len({r["pid"] for r in status[1]["replicas"]}) == 2


async def test_a_shared_prefix_goes_where_it_is_cached(omni):
    head = "You are a helpful assistant who answers in one short line. " * 3
    await collect(omni, head + "first question", ["text"], request_id="prefix-a")
    first = omni.clients[0].placed("prefix-a")
    for i in range(3):
        await collect(omni, head + f"question {i}", ["text"], request_id=f"prefix-{i}")
        assert omni.clients[0].placed(f"prefix-{i}") == first
    status = (await replicas(omni, 0))[first]
    assert status["prefix_cache"]["hit_tokens"] > 0


async def test_one_replica_sleeps_while_the_stage_serves_on(omni):
    acks = await omni.sleep([1], level=2, replica_ids=[1])
    assert [(a["replica_id"], a["status"]) for a in acks] == [(1, "SUCCESS")]
    assert omni.gate.stages[1].state == "awake" and 1 not in omni.sleeping_stage_ids()
    asleep = (await replicas(omni, 1))[1]
    assert asleep["state"] == "asleep" and asleep["memory"]["released_bytes"] > 0
    results = await asyncio.gather(*(collect(omni, f"while asleep {i}", IMAGE,
                                             request_id=f"half-{i}") for i in range(3)))  # fmt: skip
    assert all(r.pngs for r in results)
    assert {omni.clients[1].placed(f"half-{i}") for i in range(3)} == {0}
    acks = await omni.wake_up([1], replica_ids=[1])
    assert [(a["replica_id"], a["status"]) for a in acks] == [(1, "SUCCESS")]
    assert [r["state"] for r in await replicas(omni, 1)] == ["awake", "awake"]


async def test_the_stage_sleeps_when_no_replica_serves(omni):
    await omni.sleep([1], level=1, replica_ids=[0])
    assert omni.gate.stages[1].state == "awake"
    acks = await omni.sleep([1], level=1, replica_ids=[1])  # the last one serving
    assert [a["replica_id"] for a in acks] == [1]
    assert omni.gate.stages[1].state == "asleep"
    with pytest.raises(StageAsleepError):
        await collect(omni, "nobody draws", IMAGE)
    acks = await omni.wake_up([1])
    assert sorted(a["replica_id"] for a in acks) == [0, 1]
    assert omni.gate.stages[1].state == "awake"
    assert [r["state"] for r in await replicas(omni, 1)] == ["awake", "awake"]
    acks = await omni.sleep([1], level=2)  # the whole stage: every replica
    assert sorted(a["replica_id"] for a in acks) == [0, 1] and acks[0]["status"] == "SUCCESS"
    assert [r["state"] for r in await replicas(omni, 1)] == ["asleep", "asleep"]
    await omni.wake_up([1])
    assert (await collect(omni, "awake again", IMAGE)).pngs


async def test_a_killed_replica_comes_back_while_the_other_serves(omni):
    client = omni.clients[1]
    pid = client.replicas[1].pid
    restarts = omni.gate.stages[1].restarts
    os.kill(pid, signal.SIGKILL)
    await until(lambda: client.replicas[1].is_dead, 30, "the death noticed")
    assert omni.gate.stages[1].state == "awake"  # the stage serves on
    assert (await collect(omni, "one replica left", IMAGE)).pngs
    await until(lambda: not client.replicas[1].is_dead and 1 not in client.restarting, 60,
                "the replica back")  # fmt: skip
    assert client.replicas[1].pid != pid
    assert omni.gate.stages[1].restarts == restarts  # a replica's restart, not the stage's
    assert [r["state"] for r in await replicas(omni, 1)] == ["awake", "awake"]


async def test_a_bad_replica_id_is_named(omni):
    from omnistage.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="replica_ids"):
        await omni.sleep([1], replica_ids=[2])
    assert omni.gate.stages[1].state == "awake"


async def test_a_checkpoint_update_reaches_every_replica(omni):
    before = await collect(omni, "same weights", ["text"])
    acks = await omni.update_weights(0, omni.config.stages[0].model)
    assert [(a["replica_id"], a["status"]) for a in acks] == [(0, "SUCCESS"), (1, "SUCCESS")]
    assert omni.gate.stages[0].state == "awake" and not omni.gate.stages[0].paused
    assert (await collect(omni, "same weights", ["text"])).token_ids == before.token_ids


async def test_tensor_parallel_ranks_inside_each_replica():
    """2 replicas x 2 ranks: four processes, each replica its own rank 1; the greedy tokens
    are the one-process stage's."""
    prompts = [f"hello {i}" for i in range(4)]

    async def tokens(config) -> tuple[list[list[int]], dict]:
        engine = AsyncOmni.from_config(config)
        try:
            results = await asyncio.gather(
                *(collect(engine, p, ["text"], request_id=f"tp-{i}") for i, p in enumerate(prompts))
            )
            status = (await engine.stage_status())[0]
            return [r.token_ids for r in results], status
        finally:
            engine.shutdown()

    alone, _ = await tokens(load_pipeline("tiny-chat"))
    split, status = await tokens(
        with_replicas(load_pipeline("tiny-chat", tensor_parallel_size=2), ["0=2"])
    )
    assert split == alone
    ranks = [(r["pid"], *r["rank_pids"]) for r in status["replicas"]]
    assert len(ranks) == 2 and len({pid for pids in ranks for pid in pids}) == 4
