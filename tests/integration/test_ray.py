"""Stages placed by Ray: a simulated two-node cluster (``ray.cluster_utils.Cluster``, custom
resources ``node_a`` / ``node_b``) serves tiny-omni with stage 0 pinned to node A and stage 1
to node B; chat text + image works, the seed's sleep/wake sequence works on both stages, a
tensor-parallel stage runs its ranks on one node, a stage's two replicas run one per node
(by their replica_placements, or spread by the launcher), both serve, and a killed replica
comes back while the other serves; shutdown leaves no actor behind.
One cluster for the module (it takes ~4 s to start)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

import pytest_asyncio  # noqa: E402

from omnistage.config import PipelineConfig, StageConfig  # noqa: E402
from omnistage.engine.async_omni import AsyncOmni  # noqa: E402
from omnistage.engine.supervisor import RestartPolicy  # noqa: E402
from omnistage.entrypoints.openai.server_config import with_replicas  # noqa: E402
from omnistage.pipelines import load_pipeline  # noqa: E402
from tests.integration.helpers import GREEDY, collect, until  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 2}}
    )
    node_b = cluster.add_node(num_cpus=3, resources={"node_b": 3})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, cluster.head_node.node_id, node_b.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def placed(name: str, *placements: dict, **overrides) -> PipelineConfig:
    base = load_pipeline(name, enable_sleep_mode=True, **overrides)
    stages = [
        {**stage.model_dump(), "placement": placement}
        for stage, placement in zip(base.stages, placements, strict=True)
    ]
    return PipelineConfig.model_validate({"name": base.name, "stages": stages})


@pytest_asyncio.fixture(scope="module")
async def omni(cluster):
    config = placed("tiny-omni", {"resources": {"node_a": 1}}, {"resources": {"node_b": 1}})
    engine = AsyncOmni.from_config(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def alive_actors() -> list[dict]:
    from ray._private.state import state

    return [a for a in state.actor_table(None).values() if a["State"] != "DEAD"]


async def test_stages_run_on_the_nodes_their_placement_names(omni, cluster):
    _, node_a, node_b = cluster
    assert [client._handle.node_id for client in omni.clients] == [node_a, node_b]


async def test_chat_text_and_image_across_nodes(omni):
    result = await collect(omni, "a red square", ["text", "image"])
    assert result.text and len(result.pngs) == 1 and result.pngs[0][:4] == b"\x89PNG"


async def test_the_seeds_sleep_and_wake_sequence_on_both_stages(omni):
    reference = await collect(omni, "a red square", ["text", "image"])
    for stage_id, level in ((0, 2), (1, 1), (1, 2)):
        (ack,) = await omni.sleep([stage_id], level=level)
        assert ack["status"] == "SUCCESS", ack
        assert ack["freed_bytes"] > 0 or level == 1  # level 1 on a host keeps the backup
    acks = await omni.wake_up([0, 1])
    assert [a["status"] for a in acks] == ["SUCCESS", "SUCCESS"]
    await omni.resume_generation([0, 1])
    again = await collect(omni, "a red square", ["text", "image"])
    assert again.token_ids == reference.token_ids and again.pngs == reference.pngs


async def test_a_killed_actor_is_a_dead_stage_restarted_in_a_new_actor(omni, cluster):
    _, node_a, _ = cluster
    old = omni.clients[0]._handle
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        handle = omni.clients[0]._handle
        if handle is not old and omni.stage_states()[0].state == "awake":
            break
    else:
        raise AssertionError(f"stage 0 not back: {omni.stage_states()}")
    assert handle.node_id == node_a  # placed by its placement again
    result = await collect(omni, "a red square", ["text", "image"])
    assert result.text and len(result.pngs) == 1


async def test_a_tensor_parallel_stage_keeps_its_ranks_on_one_node(cluster):
    _, _, node_b = cluster
    config = placed("tiny-chat", {"resources": {"node_b": 1}}, tensor_parallel_size=2)
    engine = AsyncOmni.from_config(config)
    try:
        assert engine.clients[0]._handle.node_id == node_b
        # Rank 1 is a Ray actor of the stage's placement group, on the same node.
        ranks = [a for a in alive_actors() if a["ActorClassName"] == "RankActor"]
        assert [a["Address"]["NodeID"] for a in ranks] == [node_b]
        result = await collect(engine, "hello", sampling=GREEDY)
        assert len(result.token_ids) > 0
        acks = await engine.sleep([0], level=1)
        assert [a["rank"] for a in acks] == [0, 1]  # one ACK per rank
    finally:
        engine.shutdown()
    assert not [a for a in alive_actors() if a["ActorClassName"] == "RankActor"]


def test_each_replicas_group_goes_where_its_placement_or_the_spread_says(cluster):
    from omnistage.engine.ray_launcher import placement_group_for

    _, node_a, node_b = cluster
    on_b, on_a = {"resources": {"node_b": 1}}, {"resources": {"node_a": 1}}
    pinned = StageConfig(
        stage_id=0, kind="ar", model="m", replicas=2, replica_placements=[on_b, on_a]
    )
    spread = StageConfig(stage_id=0, kind="ar", model="m", replicas=2)

    def nodes(stage: StageConfig) -> list[str]:
        groups = [placement_group_for(ray, stage.replica_config(i), 30) for i in range(2)]
        try:
            return [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in groups]
        finally:
            for group in groups:
                ray.util.remove_placement_group(group)

    assert nodes(pinned) == [node_b, node_a]
    assert nodes(spread) == sorted([node_a, node_b])  # replica i on node i, in node-id order


async def test_replicas_spread_over_the_nodes_and_one_killed_comes_back(cluster):
    _, node_a, node_b = cluster
    config = with_replicas(load_pipeline("tiny-chat", torch_threads=1), ["0=2"])  # no placement
    fast = RestartPolicy(max_restarts=5, window_s=600, backoff_s=0.05, max_backoff_s=0.2)
    engine = AsyncOmni.from_config(config, distributed_executor_backend="ray", restart_policy=fast)
    try:
        client = engine.clients[0]
        spread = [r._handle.node_id for r in client.replicas]
        assert spread == sorted([node_a, node_b])  # one per node (the launcher's spread)
        results = await asyncio.gather(
            *(collect(engine, f"hello {i}", request_id=f"across-{i}") for i in range(4))
        )
        assert all(r.token_ids for r in results)
        assert {client.placed(f"across-{i}") for i in range(4)} == {0, 1}  # both nodes served
        pid = client.replicas[1].pid
        os.kill(pid, signal.SIGKILL)
        await until(lambda: client.replicas[1].is_dead, 30, "the death noticed")
        assert (await collect(engine, "one replica left", request_id="left")).token_ids
        assert client.placed("left") == 0 and engine.gate.stages[0].state == "awake"
        await until(lambda: not client.replicas[1].is_dead and 1 not in client.restarting, 60,
                    "the replica back")  # fmt: skip
        assert client.replicas[1].pid != pid
        assert client.replicas[1]._handle.node_id == spread[1]  # back on its node
        results = await asyncio.gather(
            *(collect(engine, f"again {i}", request_id=f"again-{i}") for i in range(4))
        )
        assert all(r.token_ids for r in results)
        assert {client.placed(f"again-{i}") for i in range(4)} == {0, 1}
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_actor_behind(omni, cluster):
    omni.shutdown()
    assert not [a for a in alive_actors() if "StageActor" in str(a.get("ActorClassName"))]
    deadline = time.monotonic() + 10  # placement groups are removed asynchronously
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if free.get("node_a") == 2 and free.get("node_b") == 3:
            break
        time.sleep(0.2)
    assert free.get("node_a") == 2 and free.get("node_b") == 3, free  # placement groups gone
