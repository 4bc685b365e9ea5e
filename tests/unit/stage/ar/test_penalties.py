"""vLLM's sampling penalties (repetition, frequency, presence) and min-p: their formulas,
their validation, how they travel to a stage, and what they do to the engine's tokens."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from omnistage.errors import InvalidRequestError
from omnistage.stage.ar import sampler as sampler_module
from omnistage.stage.ar.sampler import Sampler, apply_penalties, filter_logits
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest, SequenceState
from omnistage.stage.ar.wire import ARStageRequest
from omnistage.stage.messages import AddRequest, decode_to_stage, encode
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine

VOCAB = 64
PROMPT = [11, 22, 33, 44, 55]


def random_case(seed: int) -> tuple[torch.Tensor, list[int], int]:
    """Logits of both signs, and prompt + output ids with repeats in each and across."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 4
    prompt = torch.randint(0, VOCAB // 2, (12,), generator=gen).tolist()
    output = torch.randint(VOCAB // 4, VOCAB, (9,), generator=gen).tolist()
    return logits, prompt + output, len(prompt)


def sequence(params: SamplingParams, prompt: list[int], output: list[int]) -> SequenceState:
    seq = SequenceState(ARRequest("r", prompt, params), detokenizer=None, generator=None)  # type: ignore[arg-type]
    seq.token_ids += output
    return seq


@pytest.mark.parametrize("penalty", [1e-3, 0.5, 1.0, 1.3, 2.0, 100.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_transformers(penalty, seed):
    logits, ids, num_prompt = random_case(seed)
    params = SamplingParams(repetition_penalty=penalty)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())
    assert torch.equal(apply_penalties(logits, params, ids, num_prompt), expected[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"frequency_penalty": 0.5},
        {"frequency_penalty": -2.0},
        {"presence_penalty": 1.5},
        {"presence_penalty": -0.25},
        {"frequency_penalty": 2.0, "presence_penalty": 2.0},
        {"frequency_penalty": 0.3, "presence_penalty": -0.7, "repetition_penalty": 1.5},
    ],
)
def test_frequency_and_presence_penalties_follow_the_formula(kwargs):
    logits, ids, num_prompt = random_case(7)
    params = SamplingParams(**kwargs)
    output = ids[num_prompt:]
    expected = logits.double().tolist()
    for t in range(VOCAB):
        if t in ids and params.repetition_penalty != 1.0:  # first, as vLLM
            p = params.repetition_penalty
            expected[t] = expected[t] / p if expected[t] > 0 else expected[t] * p
        count = output.count(t)  # the output's tokens only, not the prompt's
        expected[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    got = apply_penalties(logits, params, ids, num_prompt)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64))


def test_frequency_and_presence_penalties_ignore_the_prompt():
    logits, ids, num_prompt = random_case(3)
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)
    assert torch.equal(apply_penalties(logits, params, ids[:num_prompt], num_prompt), logits)


@pytest.mark.parametrize(
    ("min_p", "temperature", "kept"),
    [
        (0.0, 1.0, [True, True, True, True]),
        (0.2, 1.0, [True, True, True, False]),  # keeps p >= 0.1
        (0.5, 1.0, [True, True, False, False]),  # keeps p >= 0.25
        (1.0, 1.0, [True, False, False, False]),  # the most likely token always stays
        (0.5, 2.0, [True, True, True, False]),  # after temperature: p ~ sqrt(p), flatter
    ],
)
def test_min_p_drops_tokens_below_its_share_of_the_most_likely(min_p, temperature, kept):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    params = SamplingParams(min_p=min_p, temperature=temperature)
    assert filter_logits(logits, params).isfinite().tolist() == kept


def test_min_p_then_top_p_as_vllm():
    # min-p drops the 0.05 and 0.15 first; top-p then sees 0.625 / 0.375 and keeps only one.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = filter_logits(logits, SamplingParams(min_p=0.5, top_p=0.6)).isfinite().tolist()
    assert kept == [True, False, False, False]


def test_each_row_is_penalised_by_its_own_output():
    """Two samples of one prompt, same logits row: each avoids the token it produced."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = logits[:, 5] = 1.0
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    seqs = [sequence(params, PROMPT, [3]), sequence(params, PROMPT, [5])]
    sampled = Sampler([], torch.Generator())(logits, seqs)
    assert sampled.token_ids == [5, 3]
    alone = Sampler([], torch.Generator())(logits[1:], seqs[1:])
    assert alone.token_ids == [3]


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_logprobs_are_raw_or_include_the_penalties(temperature, processed):
    logits, ids, num_prompt = random_case(11)
    params = SamplingParams(temperature=temperature, seed=0, logprobs=2, repetition_penalty=1.7,
                            frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05)  # fmt: skip
    seq = sequence(params, ids[:num_prompt], ids[num_prompt:])
    seq.generator = torch.Generator().manual_seed(0)
    sampled = Sampler([], torch.Generator(), processed_logprobs=processed)(logits[None], [seq])
    penalised = apply_penalties(logits, params, ids, num_prompt)
    if not processed:
        expected = torch.log_softmax(logits, dim=-1)
    elif temperature == 0:
        expected = torch.log_softmax(penalised, dim=-1)
    else:
        expected = torch.log_softmax(filter_logits(penalised, params), dim=-1).float()
    assert torch.equal(sampled.logprobs[0], expected)
    if temperature == 0:
        assert sampled.token_ids == [int(penalised.argmax())]


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_extreme_repetition_penalties_stay_finite(temperature):
    logits = torch.tensor([[3.0e38, -3.0e38, 0.0, 1.0]])
    for penalty in (1e-300, 100.0):
        params = SamplingParams(temperature=temperature, seed=0, logprobs=1,
                                repetition_penalty=penalty, min_p=0.5, top_p=0.5)  # fmt: skip
        seq = sequence(params, [0, 1, 2, 3], [])
        sampled = Sampler([], torch.Generator(), processed_logprobs=True)(logits, [seq])
        assert sampled.token_ids[0] is not None
        assert not sampled.logprobs[0].isnan().any()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 100.5}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
    ],
)
def test_bad_penalties_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_penalties_at_their_bounds_are_valid():
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=100, min_p=1)
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2, repetition_penalty=1e-9, min_p=0)
    params = SamplingParams.from_dict({"presence_penalty": 0.5, "min_p": 0.1})
    assert params.has_penalties and not SamplingParams(min_p=0.5).has_penalties


def test_penalties_travel_to_a_stage_and_are_revalidated():
    params = SamplingParams(presence_penalty=-1.5, frequency_penalty=0.25,
                            repetition_penalty=1.1, min_p=0.05)  # fmt: skip
    message = AddRequest("a", ARStageRequest([1, 2], params, False))
    decoded = decode_to_stage(encode(message))
    assert isinstance(decoded, AddRequest) and isinstance(decoded.request, ARStageRequest)
    assert decoded.request.sampling_params == params
    raw = msgspec.msgpack.encode(
        {"type": "AddRequest", "request_id": "x",
         "request": {"type": "ar", "prompt_token_ids": [1],
                     "sampling_params": {"repetition_penalty": 0}}}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="repetition_penalty"):
        decode_to_stage(raw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(build_micro(tmp_path_factory.mktemp("micro")))


def test_a_large_presence_penalty_never_repeats_a_greedy_token(engine):
    plain = generate(engine, [ARRequest("plain", PROMPT, greedy(24))])["plain"].token_ids
    assert len(set(plain)) < len(plain)  # the model repeats itself without it
    for name, kwargs in {"presence": {"presence_penalty": 2.0},
                         "frequency": {"frequency_penalty": 2.0}}.items():  # fmt: skip
        tokens = generate(engine, [ARRequest(name, PROMPT, greedy(24, **kwargs))])[name].token_ids
        assert len(tokens) == 24 and len(set(tokens)) == 24, (name, tokens)


def test_default_parameters_never_touch_the_penalties(engine, monkeypatch):
    before = generate(engine, [ARRequest("a", PROMPT, greedy(12))])["a"].token_ids

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("penalties applied at the defaults")

    monkeypatch.setattr(sampler_module, "apply_penalties", refuse)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, n=2)
    results = generate(engine, [ARRequest("b", PROMPT, greedy(12)), ARRequest("s", PROMPT, seeded)])
    assert results["b"].token_ids == before
    assert len(results["s"].token_ids) == 24  # both samples


def penalised(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True,
                          repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6,
                          min_p=0.02)  # fmt: skip


def test_penalised_samples_are_reproducible_batch_independent_and_their_own(engine):
    alone = generate(engine, [ARRequest("a", PROMPT, penalised(7))])["a"].token_ids
    crowd = [ARRequest(f"c{i}", [5 + i] * (3 + i), penalised(100 + i)) for i in range(5)]
    together = generate(engine, [*crowd[:2], ARRequest("b", PROMPT, penalised(7)), *crowd[2:]])
    assert together["b"].token_ids == alone
    # n=3 samples fork from one prefill; sample i equals the request with seed 7 + i alone.
    engine.add_request(ARRequest("n", PROMPT, penalised(7, n=3)))
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
    assert samples[0] == alone
    for i in (1, 2):
        single = generate(engine, [ARRequest(f"s{i}", PROMPT, penalised(7 + i))])[f"s{i}"]
        assert samples[i] == single.token_ids, f"sample {i}"
