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
