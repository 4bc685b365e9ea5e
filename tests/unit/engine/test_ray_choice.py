"""When a pipeline runs on Ray, and what happens without Ray installed."""

import sys

import pytest

from omnistage.config import ConfigError, PipelineConfig, parse_pipeline_config
from omnistage.engine.spawn import uses_ray
from omnistage.errors import StageStartupError
from omnistage.pipelines import parse_pipeline


def pipeline(**stage0) -> PipelineConfig:
    return parse_pipeline_config(
        {"stages": [{"stage_id": 0, "kind": "ar", "model": "m", **stage0}]}, "test"
    )


def test_a_placement_or_the_backend_chooses_ray():
    assert not uses_ray(pipeline())
    assert uses_ray(pipeline(), "ray")
    assert uses_ray(pipeline(placement={"resources": {"node_a": 1}, "num_gpus": 1}))
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        uses_ray(pipeline(), "slurm")


def test_placement_fields_are_checked():
    with pytest.raises(ConfigError, match="placement.num_gpus"):
        pipeline(placement={"num_gpus": -1})
    with pytest.raises(ConfigError, match="placement.zone"):
        pipeline(placement={"zone": "a"})


def test_tensor_parallel_size_is_for_kinds_that_split():
    with pytest.raises(ConfigError, match=r"stages.0.tensor_parallel_size: a 'diffusion' stage"):
        parse_pipeline(
            {"stages": [{"stage_id": 0, "kind": "diffusion", "model": "m",
                         "tensor_parallel_size": 2}]},
            "test",
        )  # fmt: skip


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    from omnistage.engine.ray_launcher import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(StageStartupError, match=r"omnistage\[ray\]"):
        import_ray()


def test_nothing_imports_ray_for_a_local_pipeline():
    import subprocess

    code = (
        "import sys\n"
        "from omnistage.engine.async_omni import AsyncOmni\n"
        "import omnistage.entrypoints.openai.api_server\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- replicas on Ray ----------------------------------------------------------------------------


def test_each_replica_takes_its_own_placement():
    on_a, on_b = {"resources": {"node_a": 1}}, {"resources": {"node_b": 1}, "num_cpus": 2}
    stage = pipeline(replicas=2, replica_placements=[on_a, on_b]).stages[0]
    assert uses_ray(pipeline(replicas=2, replica_placements=[on_a, on_b]))
    placements = [stage.replica_config(i).placement for i in range(2)]
    assert [p.model_dump() if p else None for p in placements] == [
        {"resources": {"node_a": 1}, "num_cpus": 1, "num_gpus": 0},
        {"resources": {"node_b": 1}, "num_cpus": 2, "num_gpus": 0},
    ]
    with pytest.raises(ConfigError, match=r"replica_placements: 1 placements for 2 replicas"):
        pipeline(replicas=2, replica_placements=[on_a])
    with pytest.raises(ConfigError, match=r"stages.0.replica_placements.0.zone"):
        pipeline(replicas=1, replica_placements=[{"zone": "a"}])


def test_a_replica_given_gpus_by_ray_keeps_the_stages_device():
    # Ray hands each replica's actor its own GPUs, which it sees from cuda:0 on.
    gpu = {"num_gpus": 1}
    for stage0 in ({"placement": gpu}, {"replica_placements": [gpu, gpu]}):
        stage = pipeline(device="cuda:0", replicas=2, **stage0).stages[0]
        assert [stage.replica_config(i).device for i in range(2)] == ["cuda:0", "cuda:0"]
    local = pipeline(device="cuda:0", replicas=2, placement={"num_cpus": 1}).stages[0]
    assert local.replica_config(1).device == "cuda:1"  # no GPUs from Ray: the local rule


def test_replicas_spread_round_robin_over_the_nodes_that_fit():
    from omnistage.engine.ray_launcher import spread_node

    def node(node_id, alive=True, **resources):
        return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4, **resources}}

    nodes = [node("c", GPU=1), node("b", GPU=2), node("a"), node("d", alive=False, GPU=8)]
    bundle = {"CPU": 1.0}
    stage = pipeline(replicas=3).stages[0]
    assert [spread_node(nodes, stage.replica_config(i), bundle) for i in range(3)] == [
        "a",
        "b",
        "c",
    ]
    gpus = {"CPU": 1.0, "GPU": 1.0}  # a's no GPU and d's dead: b, c, b
    assert [spread_node(nodes, stage.replica_config(i), gpus) for i in range(3)] == ["b", "c", "b"]
    tp = pipeline(replicas=2, tensor_parallel_size=2).stages[0]  # two ranks' GPUs on one node
    assert [spread_node(nodes, tp.replica_config(i), gpus) for i in range(2)] == ["b", "b"]
    assert spread_node(nodes, stage.replica_config(0), {"CPU": 1.0, "node_z": 1.0}) is None
    assert spread_node(nodes, pipeline().stages[0], bundle) is None  # one replica: Ray's choice
    pinned = pipeline(replicas=2, replica_placements=[{}, {}]).stages[0]
    assert spread_node(nodes, pinned.replica_config(1), bundle) is None  # placed by its own
