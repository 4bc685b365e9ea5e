"""Fair share in the AR scheduler: a request of ``n = max_num_seqs`` long samples cannot make
a short request wait for all of them, and the samples it gives up for a while come out the
same as if it had run alone."""

from __future__ import annotations

import pytest

from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.stage.ar.helpers import build_micro, greedy, make_engine

MAX_NUM_SEQS = 8
BIG = SamplingParams(n=MAX_NUM_SEQS, temperature=1.0, seed=3, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return build_micro(tmp_path_factory.mktemp("micro"))


def step_into(engine, samples: dict) -> set[str]:
    """One step; the tokens by (request, sample); the requests that finished."""
    finished = set()
    for out in engine.step():
        samples.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        if out.finished:
            finished.add(out.request_id)
    return finished


def run_all(engine, samples: dict) -> None:
    while engine.has_unfinished_requests():
        step_into(engine, samples)


def test_a_short_request_beside_n_max_num_seqs_samples_answers_within_a_few_steps(micro):
    alone: dict = {}
    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS)
    engine.add_request(ARRequest("big", [5, 6, 7, 8], BIG))
    run_all(engine, alone)

    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS)
    samples: dict = {}
    engine.add_request(ARRequest("big", [5, 6, 7, 8], BIG))
    for _ in range(4):  # every slot holds a sample of "big", decoding
        step_into(engine, samples)
    assert len(engine.scheduler.running) == MAX_NUM_SEQS
    engine.add_request(ARRequest("probe", [9, 8, 7], greedy(2)))
    steps = 0
    while True:
        steps += 1
        if "probe" in step_into(engine, samples):
            break
        assert steps < 10, "the probe waited for the long samples"
    assert engine.scheduler.num_preemptions >= 1
    run_all(engine, samples)
    big = {key: tokens for key, tokens in samples.items() if key[0] == "big"}
    assert big == alone  # preempted samples resume with the tokens they would have had
    assert len(samples[("probe", 0)]) == 2


def test_a_newcomer_that_fits_preempts_nothing(micro):
    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS)
    engine.add_request(ARRequest("a", [5, 6, 7], SamplingParams(n=4, temperature=0, max_tokens=30)))
    engine.add_request(ARRequest("b", [7, 6, 5], SamplingParams(n=3, temperature=0, max_tokens=30)))
    samples: dict = {}
    for _ in range(3):
        step_into(engine, samples)
    engine.add_request(ARRequest("c", [1, 2, 3], greedy(2)))  # one slot is free
    run_all(engine, samples)
    assert engine.scheduler.num_preemptions == 0


def test_a_newcomer_too_big_for_any_fair_share_preempts_nothing(micro):
    # "b" needs every slot: even all of "a"'s excess would not make room, so "a" keeps running.
    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS)
    engine.add_request(ARRequest("a", [5, 6, 7, 8], BIG))
    samples: dict = {}
    for _ in range(3):
        step_into(engine, samples)
    engine.add_request(ARRequest("b", [8, 7, 6, 5], BIG))
    run_all(engine, samples)
    assert engine.scheduler.num_preemptions == 0
    assert len([key for key in samples if key[0] == "b"]) == MAX_NUM_SEQS


def test_a_short_request_is_not_held_behind_samples_the_kv_cache_preempted(micro):
    """When the KV cache, not the slots, runs out, a big request's decode preempts its own
    samples and they wait first in line; a newcomer behind them once waited until the other
    samples finished (a 2-token chat 290 s beside n=32 x 3000 tokens). A request with
    nothing running goes before another's preempted excess, and a decode that runs out
    preempts the newest sample of the request holding the most, not the newcomer."""
    alone: dict = {}
    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS)
    engine.add_request(ARRequest("big", [5, 6, 7, 8], BIG))
    run_all(engine, alone)

    engine = make_engine(micro, max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=20 * 8192)
    assert engine.scheduler.block_manager.num_blocks <= 20  # 8 samples x 124 tokens need 64
    samples: dict = {}
    engine.add_request(ARRequest("big", [5, 6, 7, 8], BIG))
    while engine.scheduler.num_preemptions < 8:  # the cache ran out: samples wait in line
        step_into(engine, samples)
    assert engine.scheduler.waiting
    engine.add_request(ARRequest("probe", [9, 8, 7], greedy(4)))
    steps = 0
    while "probe" not in step_into(engine, samples):
        steps += 1
        assert steps < 10, "the probe waited behind the preempted samples"
    run_all(engine, samples)
    big = {key: tokens for key, tokens in samples.items() if key[0] == "big"}
    assert big == alone  # preempted samples resume with the tokens they would have had
    assert len(samples[("probe", 0)]) == 4
