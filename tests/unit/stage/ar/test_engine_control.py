import pytest

from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    WeightsInvalidError,
)
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.memory.residency import resident_bytes
from tests.unit.stage.ar.helpers import (
    build_micro,
    collect,
    generate,
    greedy,
    make_engine,
    run_to_completion,
)

NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return build_micro(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="module")
def engine(micro):
    return make_engine(micro)


@pytest.fixture(autouse=True)
def awake_and_resumed(engine):
    yield
    if engine.is_sleeping():
        engine.wake_up()
    engine.resume()
    run_to_completion(engine)


def batch(tag: str) -> list[ARRequest]:
    return [
        ARRequest(f"{tag}{i}", [7 + i, 40 + 3 * i, 99, 200 + i], greedy(20 + i))
        for i in range(NUM_REQUESTS)
    ]


@pytest.fixture(scope="module")
def reference(engine):
    results = generate(engine, batch("ref"))
    return [results[f"ref{i}"].token_ids for i in range(NUM_REQUESTS)]


def start_decoding(engine, tag: str, steps: int = 4) -> dict:
    for request in batch(tag):
        engine.add_request(request)
    results: dict = {}
    for _ in range(steps):
        collect(engine.step(), results)
    assert len(engine.scheduler.running) == NUM_REQUESTS
    return results


def test_sleep_abort_ends_running_requests_with_abort(engine):
    results = start_decoding(engine, "abort")
    ack = engine.sleep(level=1, mode="abort")
    assert ack.status == "SUCCESS" and ack.metadata.aborted == NUM_REQUESTS
    assert ack.metadata.mode == "abort"
    run_to_completion(engine, results)
    assert [results[f"abort{i}"].finish_reason for i in range(NUM_REQUESTS)] == [
        "abort"
    ] * NUM_REQUESTS


def test_sleep_wait_refuses_until_drained_then_requests_finish_normally(engine, reference):
    results = start_decoding(engine, "wait")
    with pytest.raises(RuntimeError, match="is_drained"):
        engine.sleep(level=2, mode="wait")
    assert engine.is_paused and not engine.is_sleeping()
    while not engine.is_drained():
        collect(engine.step(), results)
    ack = engine.sleep(level=2, mode="wait")
    assert ack.status == "SUCCESS" and ack.metadata.aborted == 0
    assert [results[f"wait{i}"].token_ids for i in range(NUM_REQUESTS)] == reference
    assert {r.finish_reason for r in results.values()} == {"length"}


def test_sleep_keep_continues_after_wake_and_resume_with_same_tokens(engine, reference):
    results = start_decoding(engine, "keep")
    ack = engine.sleep(level=2, mode="keep")
    assert ack.metadata.preempted == NUM_REQUESTS and engine.is_sleeping()
    assert engine.wake_up().status == "SUCCESS"
    assert engine.step() == [] and engine.has_unfinished_requests()  # paused until resume
    engine.resume()
    run_to_completion(engine, results)
    assert [results[f"keep{i}"].token_ids for i in range(NUM_REQUESTS)] == reference


def test_a_wake_asked_to_resume_schedules_at_once_with_the_same_tokens(engine, reference):
    results = start_decoding(engine, "resumed")
    engine.sleep(level=1, mode="keep")
    partial = engine.wake_up(tags=["weights"], resume=True)
    assert partial.status == "SUCCESS" and partial.metadata.paused  # the KV cache still sleeps
    ack = engine.wake_up(resume=True)
    assert ack.status == "SUCCESS" and not ack.metadata.paused and not engine.is_paused
    run_to_completion(engine, results)  # no resume() call
    assert [results[f"resumed{i}"].token_ids for i in range(NUM_REQUESTS)] == reference


def test_the_kv_cache_comes_back_without_its_pages_and_refills_them_as_used(engine, reference):
    kv = engine.worker.runner.kv_cache.tensor
    engine.sleep(level=1)
    assert resident_bytes(kv) == 0
    engine.wake_up()
    assert resident_bytes(kv) == 0  # mapped back, nothing faulted in
    engine.resume()
    results = generate(engine, batch("paged"))
    assert [results[f"paged{i}"].token_ids for i in range(NUM_REQUESTS)] == reference
    assert 0 < resident_bytes(kv) < kv.numel() * kv.element_size() // 2  # what they used


def test_pause_wait_holds_new_requests_until_resume(engine):
    start_decoding(engine, "held", steps=1)
    engine.pause("wait")
    engine.add_request(ARRequest("late", [1, 2, 3], greedy(4)))
    results = {}
    while not engine.is_drained():
        collect(engine.step(), results)
    assert "late" not in results and engine.has_unfinished_requests()
    engine.resume()
    run_to_completion(engine, results)
    assert results["late"].finish_reason == "length"


def test_abort_one_request_mid_decode(engine):
    results = start_decoding(engine, "one")
    engine.abort("one3")
    run_to_completion(engine, results)
    assert results["one3"].finish_reason == "abort"
    assert sum(r.finish_reason == "length" for r in results.values()) == NUM_REQUESTS - 1


def test_asleep_engine_refuses_requests(engine):
    engine.sleep(level=1)
    with pytest.raises(StageAsleepError):
        engine.add_request(ARRequest("asleep", [1, 2], greedy(2)))


def test_wake_without_reload_never_runs_on_invalid_weights(engine, reference):
    start_decoding(engine, "inv", steps=2)
    engine.sleep(level=2, mode="keep")
    ack = engine.wake_up(reload=False)
    assert ack.metadata.weights_valid is False
    with pytest.raises(WeightsInvalidError, match="update_weights"):
        engine.add_request(ARRequest("x", [1, 2], greedy(2)))
    engine.resume()
    assert engine.step() == [] and len(engine.scheduler.waiting) == NUM_REQUESTS
    engine.update_weights(engine.config.model)
    results = run_to_completion(engine)
    tails = [results[f"inv{i}"].token_ids for i in range(NUM_REQUESTS)]
    assert [
        ref[len(ref) - len(tail) :] for ref, tail in zip(reference, tails, strict=True)
    ] == tails
    assert all(len(tail) == len(ref) - 2 for ref, tail in zip(reference, tails, strict=True))


def test_repeated_sleep_is_skipped_and_deeper_sleep_drops_host_copy(engine):
    assert engine.sleep(level=1).metadata.host_backup_bytes > 0
    assert engine.sleep(level=1).status == "SKIPPED"
    deeper = engine.sleep(level=2)
    assert deeper.status == "SUCCESS" and deeper.metadata.host_backup_bytes == 0
    wake = engine.wake_up()
    assert wake.status == "SUCCESS" and wake.metadata.cuda_graph_recalled is False
    assert engine.wake_up().status == "SKIPPED"


def test_status_reports_pause_sleep_and_memory(engine):
    engine.sleep(level=1, mode="keep")
    status = engine.status()
    assert status["is_paused"] and status["is_sleeping"] and status["level"] == 1
    assert sorted(status["sleeping_tags"]) == ["kv_cache", "weights"]
    assert status["memory"]["tags"]["weights"]["resident_bytes"] == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"level": 3}, "level"), ({"mode": "later"}, "mode"), ({"tags": ["x"]}, "tags")],
)
def test_bad_sleep_arguments_name_the_field(engine, kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.sleep(**kwargs)
    assert info.value.field == field and not engine.is_paused


def test_sleep_needs_sleep_mode(micro):
    engine = make_engine(micro, enable_sleep_mode=False, kv_cache_bytes=1 << 20)
    with pytest.raises(SleepModeDisabledError):
        engine.sleep(level=1)
    engine.shutdown()


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (ARRequest("long", list(range(1, 257)), greedy(1)), "prompt"),
        (ARRequest("empty", [], greedy(1)), "prompt"),
        (ARRequest("vocab", [512], greedy(1)), "prompt"),
        (ARRequest("", [1], greedy(1)), "request_id"),
    ],
)
def test_invalid_requests_name_the_field(engine, request_, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request_)
    assert info.value.field == field
