import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.ar.sampler import filter_logits
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(build_micro(tmp_path_factory.mktemp("micro")))


def sampled(seed: int | None, max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_unknown_sampling_key_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    assert info.value.field == "best_of"


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept_k = filter_logits(logits, SamplingParams(top_k=2)).isfinite().tolist()
    kept_p = filter_logits(logits, SamplingParams(top_p=0.7)).isfinite().tolist()
    assert kept_k == [True, True, False, False]
    assert kept_p == [True, True, False, False]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    alone = generate(engine, [ARRequest("a", PROMPT, sampled(seed=7))])["a"].token_ids
    crowd = [ARRequest(f"other{i}", [5 + i] * (3 + i), sampled(seed=100 + i)) for i in range(6)]
    together = generate(engine, [*crowd[:3], ARRequest("b", PROMPT, sampled(seed=7)), *crowd[3:]])
    other_seed = generate(engine, [ARRequest("c", PROMPT, sampled(seed=8))])["c"].token_ids
    assert together["b"].token_ids == alone
    assert other_seed != alone


def test_tiny_temperature_is_greedy_instead_of_nan(engine):
    results = generate(
        engine,
        [
            ARRequest("g", PROMPT, greedy(8)),
            ARRequest(
                "t", PROMPT, SamplingParams(temperature=1e-300, max_tokens=8, ignore_eos=True)
            ),
        ],
    )
    assert results["t"].token_ids == results["g"].token_ids


def test_top_k_one_is_greedy(engine):
    results = generate(
        engine,
        [ARRequest("g", PROMPT, greedy(16)), ARRequest("k", PROMPT, sampled(seed=3, top_k=1))],
    )
    assert results["k"].token_ids == results["g"].token_ids


def test_stop_string_cuts_the_text(engine):
    full = generate(engine, [ARRequest("full", PROMPT, greedy(32))])["full"]
    stop = full.text[10:13]
    start = full.text.index(stop)
    result = generate(engine, [ARRequest("cut", PROMPT, greedy(32, stop=[stop]))])["cut"]
    assert result.finish_reason == "stop"
    assert result.text == full.text[:start]
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


def test_stop_token_id_ends_and_stays_in_the_ids(engine):
    full = generate(engine, [ARRequest("f", PROMPT, greedy(24))])["f"].token_ids
    stop_id = full[5]
    result = generate(engine, [ARRequest("s", PROMPT, greedy(24, stop_token_ids=[stop_id]))])["s"]
    assert result.finish_reason == "stop"
    assert result.token_ids == full[: full.index(stop_id) + 1]


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(engine):
    eos = min(engine.eos_token_ids)
    bias = torch.zeros(engine.model_config.vocab_size)
    bias[eos] = 100.0  # make eos the certain next token
    head = engine.worker.runner.model.lm_head
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    try:
        plain = SamplingParams(temperature=0, max_tokens=8)
        results = generate(
            engine,
            [
                ARRequest("eos", PROMPT, plain),
                ARRequest("ignore", PROMPT, greedy(8)),
                ARRequest("min", PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=3)),
            ],
        )
    finally:
        head.bias = None
    assert results["eos"].token_ids == [eos] and results["eos"].finish_reason == "stop"
    assert results["ignore"].token_ids == [eos] * 8 and results["ignore"].finish_reason == "length"
    assert len(results["min"].token_ids) == 4 and results["min"].token_ids[-1] == eos


def test_top_p_drops_a_token_once_the_ones_before_it_reach_top_p_exactly():
    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    kept = filter_logits(logits, SamplingParams(top_p=0.5)).isfinite()
    assert kept.tolist() == [True, False, False]  # transformers' TopPLogitsWarper agrees
