"""Failures that belong to requests end those requests and the engine keeps serving:
sampling parameters at their extremes always sample, non-finite logits and a batch that
raises fail their requests, a process fault propagates."""

from __future__ import annotations

import pytest
import torch

from omnistage.errors import NonFiniteOutputError, StageInternalError
from omnistage.stage.ar.sampler import Sampler, filter_logits
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = make_engine(build_micro(tmp_path_factory.mktemp("micro")))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=1e-300, max_tokens=4, ignore_eos=True),
        SamplingParams(top_p=5e-324, temperature=2.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0001e-5, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1e300, max_tokens=4, ignore_eos=True),
        SamplingParams(top_k=1, top_p=1e-300, seed=2**64 - 1, max_tokens=4, ignore_eos=True),
        SamplingParams(min_tokens=4, max_tokens=4, stop_token_ids=list(range(512))),
    ],
    ids=[
        "tiny-top-p",
        "denormal-top-p",
        "tiny-temperature",
        "huge-temperature",
        "all",
        "all-banned",
    ],
)
def test_extreme_parameters_that_pass_validation_sample(engine, params):
    out = generate(engine, [ARRequest("x", PROMPT, params)])["x"]
    if params.stop_token_ids:  # every token stops it: the ban cannot hold, the first one ends it
        assert out.finish_reason == "stop" and len(out.token_ids) == 1
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_top_p_keeps_the_most_likely_token_however_small():
    logits = torch.tensor([0.0, 3.0, 1.0, -2.0])
    kept = filter_logits(logits, SamplingParams(top_p=1e-300)).isfinite()
    assert kept.tolist() == [False, True, False, False]


def test_rows_with_non_finite_logits_get_no_token():
    sampler = Sampler({0}, torch.Generator().manual_seed(0))
    seqs = [_seq(i) for i in range(3)]
    logits = torch.randn(3, 8)
    logits[1, 2] = float("nan")
    tokens = sampler(logits, seqs).token_ids
    assert tokens[1] is None and tokens[0] is not None and tokens[2] is not None


def _seq(i: int):
    from omnistage.models.tokenizer import IncrementalDetokenizer
    from omnistage.stage.ar.sequence import SequenceState

    class NoText:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    request = ARRequest(f"s{i}", [1, 2], greedy(4))
    return SequenceState(request, IncrementalDetokenizer(NoText(), [1, 2]), None)  # type: ignore[arg-type]


def test_non_finite_logits_fail_the_request_and_the_engine_keeps_serving(engine, monkeypatch):
    before = generate(engine, [ARRequest("before", PROMPT, greedy(6))])["before"].token_ids
    real_run = engine.worker.runner.run

    def nan_for_the_second(seqs, is_prefill):
        result = real_run(seqs, is_prefill)
        for i, seq in enumerate(seqs):
            if seq.request_id == "poisoned":
                result.logits[i] = float("nan")
        return result

    monkeypatch.setattr(engine.worker.runner, "run", nan_for_the_second)
    outs = generate(
        engine,
        [ARRequest("healthy", PROMPT, greedy(6)), ARRequest("poisoned", PROMPT, greedy(6))],
    )
    assert outs["poisoned"].finish_reason == "error"
    assert isinstance(outs["poisoned"].final.error, NonFiniteOutputError)
    assert outs["healthy"].token_ids == before
    monkeypatch.undo()
    assert generate(engine, [ARRequest("after", PROMPT, greedy(6))])["after"].token_ids == before


def test_a_batch_that_raises_fails_its_requests_not_the_engine(engine, monkeypatch):
    def broken(seqs, is_prefill):
        raise IndexError("index 9 is out of bounds")

    monkeypatch.setattr(engine.worker.runner, "run", broken)
    outs = generate(engine, [ARRequest("a", PROMPT, greedy(4)), ARRequest("b", PROMPT, greedy(4))])
    assert {o.finish_reason for o in outs.values()} == {"error"}
    assert isinstance(outs["a"].final.error, StageInternalError)
    assert "IndexError" in str(outs["a"].final.error)
    monkeypatch.undo()
    assert generate(engine, [ARRequest("c", PROMPT, greedy(4))])["c"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.worker.num_kv_blocks  # nothing leaked


def test_a_process_fault_is_not_swallowed(engine, monkeypatch):
    def out_of_memory(seqs, is_prefill):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.worker.runner, "run", out_of_memory)
    engine.add_request(ARRequest("fault", PROMPT, greedy(4)))
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()
    monkeypatch.undo()
    engine.abort("fault")
    engine.step()
