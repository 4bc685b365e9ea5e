"""A reply said rather than drawn (``forced_token_ids``): each step takes the next forced id,
computed, fed back and stopped on as a drawn one — the hidden states, logprobs and text of a
sampled request whose draws were those ids, bit for bit — and the stage stops after the last.
Draws of other rows and the generators are untouched; bad ids, lengths and counts are refused
naming the field; the ids travel over the wire; a route's prompt may carry parameters for
later stages (``request_params``) and name the field its sampling is for."""

from __future__ import annotations

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.errors import ContextLengthError, InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from omnistage.stage.ar.request_preparer import ARRequestPreparer
from omnistage.stage.ar.sampler import Sampler
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest, SequenceState
from omnistage.stage.ar.wire import ARStageInfo, ARStageRequest
from omnistage.stage.messages import AddRequest, decode_to_stage, encode
from omnistage.stage.request_preparer import RequestOptions, prompt_fields, prompt_options
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(build_micro(tmp_path_factory.mktemp("micro")))


def test_a_forced_reply_is_a_drawn_ones_hidden_states_and_logprobs_bit_for_bit(engine):
    drawn = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=5)
    (sampled,) = generate(
        engine, [ARRequest("s", PROMPT, drawn, return_hidden_states=True)]
    ).values()
    reply = sampled.token_ids
    other = SamplingParams(temperature=0.7, seed=99, max_tokens=None, ignore_eos=True, logprobs=5)
    request = ARRequest("f", PROMPT, other, return_hidden_states=True, forced_token_ids=reply)
    (forced,) = generate(engine, [request]).values()
    assert forced.token_ids == reply and forced.text == sampled.text
    assert forced.finish_reason == "length"  # after the last: no draw follows
    assert forced.final is not None and sampled.final is not None
    want, got = sampled.final.handoff["hidden_states"], forced.final.handoff["hidden_states"]
    assert torch.equal(got, want)


def test_logprobs_are_the_forced_tokens(engine):
    forced_ids = [5, 6, 7, 8]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=2)
    engine.add_request(ARRequest("lp", PROMPT, params, forced_token_ids=forced_ids))
    entries = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            entries += out.logprobs or []
    assert [e.token_ids[0] for e in entries] == forced_ids  # the chosen token first
    assert all(len(e.token_ids) == 3 for e in entries)  # then the top 2


def test_the_ordinary_stop_rules_apply_as_to_drawn_tokens(engine):
    stop = SamplingParams(temperature=0, max_tokens=None, stop_token_ids=[7])
    request = ARRequest("st", PROMPT, stop, forced_token_ids=[5, 6, 7, 8, 9])
    (result,) = generate(engine, [request]).values()
    assert result.token_ids == [5, 6, 7] and result.finish_reason == "stop"
    short = ARRequest("mt", PROMPT, greedy(2), forced_token_ids=[5, 6, 7, 8, 9])
    (result,) = generate(engine, [short]).values()
    assert result.token_ids == [5, 6] and result.finish_reason == "length"


def test_requests_beside_a_forced_one_are_unchanged(engine):
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (alone,) = generate(engine, [ARRequest("a", PROMPT, sampled)]).values()
    beside = [ARRequest("b", PROMPT, sampled),
              ARRequest("f", PROMPT, greedy(8), forced_token_ids=[1, 2, 3, 4, 5, 6, 7, 8])]  # fmt: skip
    results = generate(engine, beside)
    assert results["b"].token_ids == alone.token_ids
    assert results["f"].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]


def _seq(params: SamplingParams, forced: list[int] | None = None) -> SequenceState:
    request = ARRequest("r", [1, 2, 3], params, forced_token_ids=forced)
    generator = torch.Generator().manual_seed(5) if params.seed is not None else None
    return SequenceState(request, None, generator)


def test_the_sampler_says_the_forced_token_and_moves_no_generator():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    shared = torch.Generator().manual_seed(1)
    sampler = Sampler([0], shared)
    before = shared.get_state()
    unseeded = SamplingParams(temperature=1.0)
    seeded = SamplingParams(temperature=1.0, seed=5)
    seqs = [_seq(unseeded, [42]), _seq(seeded, [43]), _seq(SamplingParams(temperature=0), [44])]
    state = seqs[1].generator.get_state()  # type: ignore[union-attr]
    assert sampler(logits, seqs).token_ids == [42, 43, 44]
    assert torch.equal(shared.get_state(), before)
    assert torch.equal(seqs[1].generator.get_state(), state)  # type: ignore[union-attr]
    plain = [_seq(seeded), _seq(seeded, [7]), _seq(seeded)]
    again = [_seq(seeded), _seq(seeded)]
    mixed = sampler(logits, plain).token_ids
    alone = sampler(logits[[0, 2]], again).token_ids
    assert [mixed[0], mixed[2]] == alone and mixed[1] == 7
    past = _seq(seeded, [7])
    past.token_ids.append(7)  # its forced ids said: it draws (the stage stops it first)
    assert past.forced_token is None


@pytest.fixture(scope="module")
def preparer():
    folder = ensure_preset("demo", cache_dir() / "demo")
    config = StageConfig(stage_id=0, kind="ar", model=str(folder))
    return ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=64))


def prepare(preparer, prompt, **options):
    fields = prompt_fields(prompt, preparer.PROMPT_FIELDS)
    return preparer.prepare(fields, RequestOptions.of(**options), Wants())


def test_the_preparer_takes_forced_ids_and_ends_the_reply_after_them(preparer):
    request = prepare(preparer, {"prompt": "hello", "forced_token_ids": [5, 6, 7]})
    assert request.forced_token_ids == [5, 6, 7] and request.sampling_params.max_tokens == 3
    given = prepare(preparer, {"prompt": "hi", "forced_token_ids": [5]},
                    sampling_params={"max_tokens": 9})  # fmt: skip
    assert given.sampling_params.max_tokens == 1
    assert prepare(preparer, "hello").forced_token_ids is None


@pytest.mark.parametrize(
    ("forced", "params", "field", "error"),
    [
        ([], {}, "forced_token_ids", InvalidRequestError),
        ([1, "2"], {}, "forced_token_ids", InvalidRequestError),
        ([True], {}, "forced_token_ids", InvalidRequestError),
        ([512], {}, "forced_token_ids", InvalidRequestError),
        ([1] * 64, {}, "forced_token_ids", ContextLengthError),
        ([1, 2, 3], {"max_tokens": 2}, "max_tokens", InvalidRequestError),
        ([1, 2, 3], {"n": 2}, "n", InvalidRequestError),
    ],
)
def test_bad_forced_replies_are_refused_naming_the_field(preparer, forced, params, field, error):
    with pytest.raises(error) as info:
        prepare(preparer, {"prompt": "hello", "forced_token_ids": forced}, sampling_params=params)
    assert info.value.field == field


def test_the_engine_refuses_what_the_preparer_would(engine):
    cases = [
        ([], "forced_token_ids"),
        ([10**6], "forced_token_ids"),
        ([1] * 300, "forced_token_ids"),
    ]
    for forced, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(ARRequest("bad", PROMPT, greedy(4), forced_token_ids=forced))
        assert info.value.field == field
    two = SamplingParams(n=2, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="one sample"):
        engine.add_request(ARRequest("bad", PROMPT, two, forced_token_ids=[1]))


def test_forced_ids_travel_to_the_stage():
    message = AddRequest("a", ARStageRequest([1, 2], forced_token_ids=[3, 4]))
    decoded = decode_to_stage(encode(message))
    assert isinstance(decoded, AddRequest) and isinstance(decoded.request, ARStageRequest)
    assert decoded.request.forced_token_ids == [3, 4]
    assert ARStageRequest([1]).forced_token_ids is None


def test_a_prompt_gives_later_stages_parameters_and_its_sampling_to_one():
    options = RequestOptions.of(sampling_params={"temperature": 0, "seed": 4})
    prompt = {"messages": [], "request_params": {"audio_params": {"voice": "Ethan"}},
              "sampling_params_for": "talker_params"}  # fmt: skip
    rest, moved = prompt_options(prompt, options)
    assert rest == {"messages": []}
    assert moved.params == {
        "sampling_params": {"seed": 4},  # the seed seeds every stage
        "talker_params": {"seed": 4, "temperature": 0},
        "audio_params": {"seed": 4, "voice": "Ethan"},
    }
    assert prompt_options("text", options) == ("text", options)
    assert prompt_options({"prompt": "x"}, options) == ({"prompt": "x"}, options)


def test_a_prompts_parameter_never_overrides_the_requests_own():
    options = RequestOptions.of(audio_params={"voice": "Chelsie"})
    same = {"prompt": "x", "request_params": {"audio_params": {"voice": "Chelsie"}}}
    assert prompt_options(same, options)[1].params["audio_params"] == {"voice": "Chelsie"}
    other = {"prompt": "x", "request_params": {"audio_params": {"voice": "Ethan"}}}
    with pytest.raises(InvalidRequestError) as info:
        prompt_options(other, options)
    assert info.value.field == "audio_params.voice"
    moved = RequestOptions.of(sampling_params={"top_k": 3}, talker_params={"top_k": 5})
    with pytest.raises(InvalidRequestError) as info:
        prompt_options({"prompt": "x", "sampling_params_for": "talker_params"}, moved)
    assert info.value.field == "talker_params.top_k"
    for bad, field in (({"request_params": 3}, "request_params"),
                       ({"request_params": {"audio_params": 3}}, "request_params.audio_params"),
                       ({"sampling_params_for": 3}, "sampling_params_for")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            prompt_options({"prompt": "x", **bad}, options)
        assert info.value.field == field
