"""Request preparation in the API process: user prompts -> validated wire requests."""

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.errors import ContextLengthError, InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from omnistage.stage.ar.request_preparer import ARRequestPreparer
from omnistage.stage.ar.wire import ARStageInfo
from omnistage.stage.diffusion.params import DiffusionParams, PipelineLimits
from omnistage.stage.diffusion.request_preparer import DiffusionRequestPreparer
from omnistage.stage.diffusion.wire import DiffusionStageInfo
from omnistage.stage.request_preparer import RequestOptions, prompt_fields

NOTHING = Wants()
LIMITS = PipelineLimits(
    size_multiple=16, embedding_dim=8, has_text_encoder=True, native_size=64,
    max_inference_steps=100, max_image_pixels=128 * 128,
)  # fmt: skip


@pytest.fixture(scope="module")
def ar():
    folder = ensure_preset("demo", cache_dir() / "demo")
    config = StageConfig(stage_id=0, kind="ar", model=str(folder))
    return ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=64))


@pytest.fixture(scope="module")
def diffusion():
    config = StageConfig(stage_id=1, kind="diffusion", model="unused")
    return DiffusionRequestPreparer(config, DiffusionStageInfo(limits=LIMITS))


def prepare(preparer, prompt, wants=NOTHING, **options):
    return preparer.prepare(
        prompt_fields(prompt, preparer.PROMPT_FIELDS), RequestOptions.of(**options), wants
    )


def test_text_and_chat_prompts_are_tokenized(ar):
    text = prepare(ar, "hello", sampling_params={"max_tokens": 3})
    assert text.prompt_token_ids and text.sampling_params.max_tokens == 3
    chat = prepare(ar, {"messages": [{"role": "user", "content": "hello"}]})
    assert len(chat.prompt_token_ids) > len(text.prompt_token_ids)  # the template adds roles


def test_hidden_states_are_asked_for_when_the_next_stage_wants_them(ar):
    assert prepare(ar, "hi", Wants(hidden_states=True)).return_hidden_states
    assert not prepare(ar, "hi").return_hidden_states


@pytest.mark.parametrize(
    ("prompt", "options", "field"),
    [
        ({}, {}, "prompt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, {}, "prompt"),
        ({"prompt_token_ids": [1, True]}, {}, "prompt_token_ids"),
        ({"prompt_token_ids": "1 2"}, {}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 512]}, {}, "prompt"),
        ({"prompt": 5}, {}, "prompt"),
        ({"messages": "hi"}, {}, "messages"),
        ({"messages": [{"content": "hi"}]}, {}, "messages.0"),
        ({"prompt": "x"}, {"sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
        ({"prompt": "x"}, {"sampling_params": [1]}, "sampling_params"),
        ({"prompt": "x"}, {"sampling_params": {"top_p": 0.0}}, "sampling_params.top_p"),
        ({"prompt": "x", "colour": "red"}, {}, "colour"),
    ],
)
def test_bad_ar_requests_name_the_field(ar, prompt, options, field):
    with pytest.raises(InvalidRequestError) as info:
        prepare(ar, prompt, **options)
    assert info.value.field == field


def test_a_prompt_that_leaves_no_room_is_too_long(ar):
    with pytest.raises(ContextLengthError) as info:
        prepare(ar, {"prompt_token_ids": [1] * 64})
    assert info.value.field == "prompt"


def test_image_params_and_negative_prompt_are_taken(diffusion):
    request = prepare(
        diffusion, {"prompt": "a cat", "negative_prompt": "blur"}, image_params={"seed": 3}
    )
    assert request.params == DiffusionParams(seed=3, negative_prompt="blur")


@pytest.mark.parametrize(
    ("prompt", "image_params", "field"),
    [
        ("a cat", "seed=3", "image_params"),
        ("a cat", [1, 2], "image_params"),
        ("a cat", {"colour": 1}, "image_params.colour"),
        ("a cat", {"height": 4096, "width": 4096}, "size"),
        ("a cat", {"num_inference_steps": 101}, "num_inference_steps"),
        ({"prompt_embeds": torch.zeros(3, 7)}, {}, "prompt_embeds"),
        ({"prompt_embeds": torch.full((3, 8), float("nan"))}, {}, "prompt_embeds"),
        ({"prompt": "x", "prompt_embeds": torch.zeros(3, 8)}, {}, "prompt"),
    ],
)
def test_bad_diffusion_requests_name_the_field(diffusion, prompt, image_params, field):
    with pytest.raises(InvalidRequestError) as info:
        prepare(diffusion, prompt, image_params=image_params)
    assert info.value.field == field


def test_a_fed_stage_keeps_every_parameter_and_refuses_n():
    """A stage fed by another (a talker): its own defaults under the user's values, its stop
    ids added to the user's (none dropped), and ``n`` refused before any stage runs."""
    folder = ensure_preset("demo", cache_dir() / "demo")
    info = ARStageInfo(
        vocab_size=512,
        max_model_len=64,
        params_field="talker_params",
        param_defaults={"temperature": 0.9, "top_k": 40},
        stop_token_ids=[7],
    )
    talker = ARRequestPreparer(StageConfig(stage_id=1, kind="ar", model=str(folder)), info)
    options = RequestOptions.of(talker_params={"temperature": 0.0, "stop_token_ids": [3, 7]})
    params = talker.template(options, NOTHING).sampling_params
    assert params.temperature == 0.0 and params.top_k == 40
    assert params.stop_token_ids == [3, 7]
    with pytest.raises(InvalidRequestError, match="talker_params.n"):
        talker.check_options(RequestOptions.of(talker_params={"n": 4}), downstream=True)


@pytest.mark.parametrize(
    "prompt",
    [
        "word " * 400_000,
        {"messages": [{"role": "user", "content": "word " * 400_000}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "w" * 2_000_000}]}]},
    ],
)
def test_a_text_surely_too_long_is_refused_without_tokenizing_it(ar, prompt, monkeypatch):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a text that no max_model_len could hold")

    monkeypatch.setattr(ar.tokenizer, "encode", no_tokenizing)
    monkeypatch.setattr(ar.tokenizer, "encode_chat", no_tokenizing)
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens"):
        prepare(ar, prompt)


def test_a_text_near_the_bound_is_tokenized_and_judged_by_its_tokens(ar):
    # Under the character bound but over max_model_len tokens: refused by its token count.
    with pytest.raises(ContextLengthError, match="tokens in the prompt, which leave no room"):
        prepare(ar, "a " * 100)


def test_an_answer_too_big_for_max_answer_logprobs_is_refused_up_front():
    folder = ensure_preset("demo", cache_dir() / "demo")
    config = StageConfig(stage_id=0, kind="ar", model=str(folder), max_answer_logprobs=10_000)
    ar = ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=4096))
    prompt = "word " * 500  # ~500 tokens
    with pytest.raises(InvalidRequestError, match="max_answer_logprobs=10000") as refused:
        prepare(ar, prompt, sampling_params={"n": 32, "prompt_logprobs": 20, "max_tokens": 4})
    assert refused.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="max_answer_logprobs") as refused:
        prepare(ar, "hi", sampling_params={"n": 8, "logprobs": 20, "max_tokens": 100})
    assert refused.value.field == "logprobs"
    # Within the bound (and without logprobs at all) requests pass.
    prepare(ar, prompt, sampling_params={"n": 2, "prompt_logprobs": 1, "max_tokens": 4})
    prepare(ar, prompt, sampling_params={"n": 64, "max_tokens": 4000})


def test_a_request_over_max_request_tokens_is_refused_naming_n_or_max_tokens():
    """n=32 x (900 + 3000) tokens held one stage's slots for minutes; an operator bounds it."""
    folder = ensure_preset("demo", cache_dir() / "demo")
    config = StageConfig(stage_id=0, kind="ar", model=str(folder), max_request_tokens=20_000)
    ar = ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=4096))
    with pytest.raises(InvalidRequestError, match="max_request_tokens=20000") as refused:
        prepare(ar, "hi", sampling_params={"n": 32, "max_tokens": 3000, "ignore_eos": True})
    assert refused.value.field == "n"
    with pytest.raises(InvalidRequestError, match="--max-request-tokens"):
        prepare(ar, "hi", sampling_params={"n": 8, "max_tokens": None})  # the rest of the context
    small = ARRequestPreparer(
        StageConfig(stage_id=0, kind="ar", model=str(folder), max_request_tokens=1000),
        ARStageInfo(vocab_size=512, max_model_len=4096),
    )
    with pytest.raises(InvalidRequestError) as refused:
        prepare(small, "hi", sampling_params={"n": 1, "max_tokens": 2000})
    assert refused.value.field == "max_tokens"
    prepare(ar, "hi", sampling_params={"n": 4, "max_tokens": 3000})  # 4 x (prompt + 3000)
    unbounded = ARRequestPreparer(
        StageConfig(stage_id=0, kind="ar", model=str(folder)),
        ARStageInfo(vocab_size=512, max_model_len=4096),
    )
    prepare(unbounded, "hi", sampling_params={"n": 32, "max_tokens": 3000})  # no bound set


def test_max_tokens_none_is_the_stages_default_else_no_limit(ar):
    """A chat without a limit sends ``max_tokens: None`` (vLLM's chat: the rest of the
    context); a stage default (``override_generation_config``) still bounds it; a request
    that does not send the key at all gets SamplingParams' 16."""
    unset = prepare(ar, "hi", sampling_params={"max_tokens": None})
    assert unset.sampling_params.max_tokens is None
    assert prepare(ar, "hi").sampling_params.max_tokens == 16
    info = ARStageInfo(vocab_size=512, max_model_len=64, param_defaults={"max_tokens": 7})
    bounded = ARRequestPreparer(ar.config, info)
    assert (
        prepare(bounded, "hi", sampling_params={"max_tokens": None}).sampling_params.max_tokens == 7
    )
    assert prepare(bounded, "hi", sampling_params={"max_tokens": 3}).sampling_params.max_tokens == 3


BUILD_AT_ONCE = """
import sys, threading
from omnistage.config import StageConfig
from omnistage.stage.ar.request_preparer import ARRequestPreparer
from omnistage.stage.ar.wire import ARStageInfo

config = StageConfig(stage_id=0, kind="ar", model=sys.argv[1], model_stage="thinker")
preparer = ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=64))
start, built, failed = threading.Barrier(8), set(), []

def build():
    start.wait()
    try:
        built.add(id(preparer.prompt_processor()))
    except Exception as exc:
        failed.append(repr(exc))

threads = [threading.Thread(target=build) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
assert not failed and len(built) == 1, (failed, built)
"""


def test_eight_threads_asking_for_the_prompt_processor_at_once_get_one():
    """The first media requests come on several threads at once; building the processor
    imports transformers' lazily loaded classes, which raced into an ImportError (a 500).
    In a fresh process, where nothing of transformers is imported yet."""
    import subprocess
    import sys

    from omnistage.pipelines import load_pipeline

    folder = load_pipeline("tiny-qwen2.5-omni").stages[0].model
    done = subprocess.run(
        [sys.executable, "-c", BUILD_AT_ONCE, folder], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
