"""Replicas, the parts that need no stage process: where a request goes (least loaded, ties in
turn, a cached prefix unless its replica is much busier), how replica ACKs roll up into the
stage's, and every bad replica setting refused naming its key (pipeline file, ``serve``
flag, the machine's cores and devices)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from omnistage.config import ConfigError, PipelineConfig, StageConfig
from omnistage.engine.launcher import InProcessLauncher
from omnistage.engine.replica_parts import ASLEEP, PrefixPlacement, check_replicas, rolled_up
from omnistage.engine.replicas import ReplicatedStageClient
from omnistage.engine.stage_client import StageClient
from omnistage.entrypoints.openai.server_config import with_replicas
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import ARStageRequest
from omnistage.stage.control import make_ack


def _stage(**extra) -> StageConfig:
    return StageConfig(**{"stage_id": 0, "kind": "ar", "model": "m", **extra})


# -- placement ----------------------------------------------------------------------------------


def test_a_prefix_is_found_at_its_longest_known_head() -> None:
    places = PrefixPlacement(block=4)
    places.record(list(range(20)), 1)  # keys for the first 4, 8 and 16 ids
    places.record(list(range(8)) + [99] * 8, 0)  # shares 8: its 4- and 8-keys now name 0
    assert places.lookup(list(range(16)) + [7]) == 1  # the 16-key: replica 1's alone
    assert places.lookup(list(range(8)) + [5, 5]) == 0
    assert places.lookup([9, 9, 9, 9, 9]) is None
    assert places.lookup([0, 1, 2]) is None  # shorter than a block: no key
    places.forget(1)
    assert places.lookup(list(range(16))) == 0  # falls back to the 8-key


def test_the_prefix_memory_is_bounded() -> None:
    places = PrefixPlacement(block=2, max_keys=8)
    for start in range(100):
        places.record([start, start], start % 2)
    assert len(places._where) == 8
    assert places.lookup([99, 99]) == 1 and places.lookup([0, 0]) is None


@pytest.fixture
def replicated():
    """Two replicas' clients, never started: their loads are the requests they hold."""
    config = _stage(replicas=2)
    launcher = InProcessLauncher()
    clients = [StageClient(config.replica_config(i), launcher) for i in range(2)]
    for client in clients:
        client.is_dead = False
    return ReplicatedStageClient(clients)


def _hold(client: StageClient, n: int) -> None:
    client._queues = {f"r{i}": asyncio.Queue() for i in range(n)}


def _request(token_ids: list[int]) -> ARStageRequest:
    return ARStageRequest(prompt_token_ids=token_ids, sampling_params=SamplingParams())


def test_the_least_loaded_replica_takes_a_request_and_ties_go_in_turn(replicated) -> None:
    _hold(replicated.replicas[0], 3)
    assert {replicated._choose(_request([1])) for _ in range(4)} == {1}
    _hold(replicated.replicas[1], 3)
    assert [replicated._choose(_request([1])) for _ in range(4)] in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_a_cached_prefix_wins_unless_its_replica_is_much_busier(replicated) -> None:
    prompt = list(range(40))
    replicated._prefixes.record(prompt, 1)
    _hold(replicated.replicas[1], replicated.prefix_slack)
    assert replicated._choose(_request(prompt + [5])) == 1  # busier, within the slack
    _hold(replicated.replicas[1], replicated.prefix_slack + 1)
    assert replicated._choose(_request(prompt + [5])) == 0


def test_asleep_or_dead_replicas_take_nothing(replicated) -> None:
    _hold(replicated.replicas[1], 5)
    replicated.states[0] = ASLEEP
    assert replicated.serving() == [1] and replicated._choose(_request([1])) == 1
    replicated.states[0] = "awake"
    replicated.replicas[0].is_dead = True
    assert replicated.serving() == [1] and not replicated.is_dead
    replicated.replicas[1].is_dead = True
    assert replicated.is_dead


def test_with_the_serving_replica_restarting_a_request_is_told_to_retry(replicated) -> None:
    """The other replica asleep (a replica's own sleep), the serving one dead and coming
    back: a 503 with Retry-After, not the asleep replica's refusal."""
    from omnistage.errors import StageRestartingError

    replicated.states[1] = ASLEEP
    replicated.replicas[0].is_dead = True
    replicated.restarting.add(0)
    with pytest.raises(StageRestartingError, match="replicas \\[0\\] restart"):
        replicated._choose(_request([1]))
    replicated.restarting.clear()  # not coming back: the asleep one says so itself
    assert replicated._choose(_request([1])) == 1


def test_the_first_ack_carries_the_stages_status() -> None:
    ok, skipped, failed = (make_ack(0, status=s) for s in ("SUCCESS", "SKIPPED", "ERROR"))
    assert rolled_up([skipped, ok]) == [ok, skipped]
    assert rolled_up([ok, skipped, failed]) == [failed, ok, skipped]
    assert rolled_up([skipped, skipped]) == [skipped, skipped]


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2, "replica_devices": ["cuda:0"]}, "replica_devices"),
        ({"replicas": 2, "replica_devices": ["cuda:0", "cuda:1"]}, "replica_devices"),  # on cpu
        ({"device": "cuda:0", "replicas": 2, "replica_devices": ["cuda:0", "cuda:0"]},
         "add up past 1"),
        ({"device": "cuda", "replicas": 2, "replica_devices": ["cuda:0", "cuda:0"],
          "gpu_memory_utilization": 0.6}, "add up past 1"),
        ({"device": "cuda", "replicas": 2, "replica_devices": ["cuda:0", "cpu"]},
         "replica_devices"),
    ],
)  # fmt: skip
def test_a_bad_replica_setting_is_named(settings, said) -> None:
    with pytest.raises(ValidationError, match=said):
        _stage(**settings)


def test_each_replica_has_its_own_device() -> None:
    stage = _stage(device="cuda:1", replicas=3, tensor_parallel_size=2)
    assert [stage.replica_config(i).device for i in range(3)] == ["cuda:1", "cuda:3", "cuda:5"]
    assert [stage.replica_config(i).replica_id for i in range(3)] == [0, 1, 2]
    shared = _stage(
        device="cuda", replicas=2, replica_devices=["cuda:0", "cuda:0"],
        gpu_memory_utilization=0.45,
    )  # fmt: skip
    assert [shared.replica_config(i).device for i in range(2)] == ["cuda:0", "cuda:0"]
    assert _stage(replicas=2).replica_config(1).device == "cpu"


def test_replicas_beyond_the_cores_or_devices_are_refused() -> None:
    pipeline = PipelineConfig(
        stages=[
            _stage(),
            StageConfig(stage_id=1, kind="ar", model="m", replicas=2, torch_threads=2),
        ]  # fmt: skip
    )
    check_replicas(pipeline, on_cpu_cores=4, cuda_devices=0)
    with pytest.raises(ConfigError, match=r"stages\.1\.replicas: 2 replicas x 1 ranks x 2"):
        check_replicas(pipeline, on_cpu_cores=3, cuda_devices=0)
    gpu = PipelineConfig(stages=[_stage(device="cuda:1", replicas=2, tensor_parallel_size=2)])
    check_replicas(gpu, on_cpu_cores=1, cuda_devices=5)
    with pytest.raises(ConfigError, match=r"stages\.0\.replicas: .* up to cuda:4; there are 4"):
        check_replicas(gpu, on_cpu_cores=1, cuda_devices=4)
    check_replicas(gpu, on_cpu_cores=1, cuda_devices=1, on_ray=True)  # Ray places them


def test_the_serve_flag_sets_a_stages_replicas() -> None:
    pipeline = PipelineConfig(stages=[_stage(name="thinker"), _stage(stage_id=1)])
    pipeline = with_replicas(pipeline, ["thinker=2", "1=3"])
    assert [s.replicas for s in pipeline.stages] == [2, 3]
    for bad in ("thinker", "nobody=2", "0=x", "0=0"):
        with pytest.raises(ConfigError, match="--stage-replicas"):
            with_replicas(pipeline, [bad])


def test_the_stages_status_sums_its_replicas_and_is_asleep_only_where_all_are() -> None:
    from omnistage.engine.replica_parts import summarized

    def replica(asleep: bool, resident: int) -> dict:
        weights = {"reserved_bytes": 10, "resident_bytes": resident, "released_bytes": 10 - resident,
                   "backup_bytes": 0, "is_asleep": asleep, "is_valid": True}  # fmt: skip
        return {
            "replica_id": 0, "state": "asleep" if asleep else "awake", "num_running": 2,
            "num_waiting": 1, "is_sleeping": asleep, "weights_valid": not asleep,
            "sleeping_tags": ["weights"] if asleep else [], "tensor_parallel_size": 1,
            "memory": {"tags": {"weights": weights}, "reserved_bytes": 10,
                       "resident_bytes": resident, "released_bytes": 10 - resident,
                       "backup_bytes": 0},
        }  # fmt: skip

    half = summarized([replica(True, 0), replica(False, 10)])
    assert (half["num_running"], half["num_waiting"], half["tensor_parallel_size"]) == (4, 2, 1)
    assert not half["is_sleeping"] and half["weights_valid"] and half["sleeping_tags"] == []
    assert half["memory"]["resident_bytes"] == 10 and half["memory"]["reserved_bytes"] == 20
    assert half["memory"]["tags"]["weights"]["released_bytes"] == 10
    assert not half["memory"]["tags"]["weights"]["is_asleep"]
    assert "replica_id" not in half and "state" not in half
    both = summarized([replica(True, 0), replica(True, 0)])
    assert (
        both["is_sleeping"] and not both["weights_valid"] and both["sleeping_tags"] == ["weights"]
    )
    assert both["memory"]["tags"]["weights"]["is_asleep"]
