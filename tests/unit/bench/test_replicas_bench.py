"""``omnistage bench replicas``: the pipeline file each server runs, and its rows from measured
runs (no processes here)."""

from __future__ import annotations

from typing import Any

import pytest

from omnistage.bench import replicas
from omnistage.config import load_pipeline_config


@pytest.mark.parametrize(
    ("pipeline", "stage_id"),
    [("tiny-qwen2.5-omni", 2), ("bench-qwen2.5-omni", 2), ("tiny-flux", 0)],
)
def test_the_file_replicates_the_step_scheduled_stage_within_the_cores(
    tmp_path, pipeline, stage_id
):
    s = replicas.ReplicaSettings()
    for count, step_threads in ((1, 2), (2, 1)):
        path, stage, speech = replicas.pipeline_file(pipeline, count, s, tmp_path, cores=2)
        assert stage["stage_id"] == stage_id and speech == pipeline.endswith("omni")
        config = load_pipeline_config(str(path))
        assert [st.replicas for st in config.stages if st.stage_id != stage_id] == [1] * (
            len(config.stages) - 1
        )
        replicated = config.stages[stage_id]
        assert (replicated.replicas, replicated.step_threads) == (count, step_threads)
        assert all(st.torch_threads == 1 for st in config.stages)
        assert all("{cache}" not in st.model for st in config.stages)


def _run(outputs: list[bytes], duration: float, cpu_s: float) -> dict[str, Any]:
    return {
        "outputs": outputs,
        "ttfa_ms": 100.0,
        "e2e_ms": 1000.0,
        "duration": duration,
        "cpu_s": cpu_s,
        "api_cpu_s": 0.01,
        "cpu_busy": cpu_s * len(outputs) / duration,
        "others_busy": 0.0,
        "cpu_s_by_process": {"thinker": 0.1, "code2wav.0": cpu_s / 3, "code2wav.1": cpu_s / 2},
    }


def _session(alone: dict, together: dict, speech: bool = True) -> dict[str, Any]:
    return {
        "stage": "2 (code2wav)",
        "name": "code2wav",
        "speech": speech,
        "step_threads": 1,
        "runs": {1: alone, 4: together},
        "sleep_wake": {"sleep": [4.0, 6.0, 5.0], "wake": [3.0, 5.0, 4.0]},
    }


def test_rows_set_the_rate_against_the_cores_bound_one_replica_and_alone():
    measured = {
        1: _session(_run([b"a", b"b", b"c", b"d"], 8.0, 2.0), _run([b"a", b"b", b"c", b"d"], 4.0, 1.5)),
        2: _session(_run([b"a", b"b", b"c", b"d"], 8.0, 2.5), _run([b"a", b"x", b"c", b"d"], 2.5, 1.5)),
    }  # fmt: skip
    rows = {
        (r["replicas"], r["concurrency"]): r for r in replicas.throughput_rows("p", measured, 2, 1)
    }
    one, two = rows[1, 4], rows[2, 4]
    assert one["core_bound_per_s"] == 1.0 and one["vs_core_bound"] == 1.0  # 2 cores / 2 CPU-s
    assert two["core_bound_per_s"] == 0.8 and two["vs_core_bound"] == 1.6 / 0.8  # its own alone
    assert two["vs_1_replica"] == 1.6 and rows[2, 1]["vs_1_replica"] == 1.0
    assert two["audio_as_alone"] == "3/4" and two["same_as_1_replica"] == "3/4"
    assert rows[1, 1]["audio_as_alone"] == "-" and rows[1, 1]["same_as_1_replica"] == "-"
    assert rows[2, 1]["same_as_1_replica"] == "4/4"
    assert two["replica_cpu_s"] == "0.5/0.75"  # code2wav.0's and code2wav.1's, not the thinker's
    assert list(two) == [*replicas.THROUGHPUT_COLUMNS, "cpu_s_by_process"]
    images = {1: _session(measured[1]["runs"][1], measured[1]["runs"][4], speech=False)}
    (alone, _) = replicas.throughput_rows("p", images, 2, 1)
    assert list(alone)[:-1] == replicas.IMAGE_COLUMNS and alone["images_per_s"] == 0.5


def test_sleep_rows_compare_the_round_trip_with_one_replicas():
    measured = {1: _session({}, {}), 2: _session({}, {})}
    measured[2]["sleep_wake"] = {"sleep": [6.0, 7.0, 8.0], "wake": [5.0, 6.0, 7.0]}
    one, two = replicas.sleep_rows("p", measured, level=1)
    assert (one["round_trip_p50_ms"], two["round_trip_p50_ms"]) == (9.0, 13.0)
    assert one["round_trip_vs_1_replica"] == 1.0 and two["round_trip_vs_1_replica"] == 13 / 9
    assert list(two) == replicas.SLEEP_COLUMNS and two["cycles"] == 3
