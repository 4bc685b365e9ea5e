import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage import LLM, RequestOutput, SamplingParams
from omnistage.config import ConfigError
from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    WeightsInvalidError,
)
from omnistage.memory import process_resident_bytes
from omnistage.models.tiny import build_preset
from omnistage.models.tiny_ar import TinyARSpec, build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox", {"prompt_token_ids": [7, 8, 9]}]
# Untied, ~39 MB of fp32 weights: big enough for the RSS drop to stand out from noise.
SIZEABLE = TinyARSpec(512, 2, 8, 2, 2048, 2048, tie_word_embeddings=False)
MiB = 1 << 20


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_preset("demo", tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def llm(demo):
    with LLM(
        str(demo), kv_cache_bytes=4 * MiB, max_model_len=256, seed=0, enable_sleep_mode=True
    ) as llm:
        yield llm


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_unknown_keyword_is_a_type_error(demo):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(demo), max_num_sequences=4)


def test_generate_accepts_strings_and_token_ids_in_order(llm):
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outputs] == ["Hello there", "The quick brown fox", None]
    assert outputs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    assert outputs[2].prompt_token_ids == [7, 8, 9]
    for out in outputs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 12
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    single = llm.generate("The quick brown fox", GREEDY)
    assert token_ids(single) == token_ids(outputs)[1:2]


def test_hidden_states_come_back_when_asked(llm):
    output = llm.generate("Hello there", GREEDY, return_hidden_states=True)[0]
    hidden = output.outputs[0].hidden_states
    assert hidden.shape == (len(output.prompt_token_ids) + 12 - 1, 256)
    assert llm.generate("Hello there", GREEDY)[0].outputs[0].hidden_states is None


def test_chat_renders_the_template(llm):
    conversation = [{"role": "user", "content": "Hi!"}]
    outputs = llm.chat([conversation, conversation], GREEDY)
    assert outputs[0].prompt == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert (
        token_ids(outputs)[0]
        == token_ids(outputs)[1]
        == token_ids(llm.chat(conversation, GREEDY))[0]
    )


def test_paused_llm_refuses_to_generate_until_resumed(llm):
    llm.pause()
    with pytest.raises(RuntimeError, match="resume"):
        llm.generate("Hello there", GREEDY)
    llm.resume()
    assert len(llm.generate("Hello there", GREEDY)) == 1


def test_sleep_wait_with_nothing_in_flight_sleeps_at_once(llm):
    (ack,) = llm.sleep(level=1, mode="wait")  # one ACK per rank
    assert ack["status"] == "SUCCESS" and ack["metadata"]["mode"] == "wait"
    with pytest.raises(StageAsleepError):
        llm.generate("Hello there", GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping()


def test_sleep_wait_that_fails_does_not_leave_the_llm_paused(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.sleep(level=3, mode="wait")
    assert info.value.field == "level"
    assert not llm.status()["is_paused"] and not llm.is_sleeping()
    assert len(llm.generate("Hello there", GREEDY)) == 1


def test_update_weights_after_reload_false_matches_transformers(llm, demo, tmp_path):
    from transformers import Qwen2ForCausalLM

    before = token_ids(llm.generate(PROMPTS, GREEDY))
    changed = {
        name: t * 1.5 if name.endswith("proj.weight") else t
        for name, t in load_file(demo / "model.safetensors").items()
    }
    save_file(changed, str(tmp_path / "changed.safetensors"))
    llm.sleep(level=2)
    llm.wake_up(reload=False)
    with pytest.raises(WeightsInvalidError, match="update_weights"):
        llm.generate(PROMPTS, GREEDY)
    (ack,) = llm.update_weights(str(tmp_path / "changed.safetensors"))
    assert ack["status"] == "SUCCESS"
    after = llm.generate(PROMPTS, GREEDY)
    reference = Qwen2ForCausalLM.from_pretrained(demo).eval()
    reference.load_state_dict(changed)
    for out in after:
        prompt = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, prompt.shape[1] :].tolist()
        assert out.outputs[0].token_ids == expected
    assert token_ids(after) != before
    llm.update_weights(str(demo))  # back to the original for the other tests
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == before


@pytest.fixture(scope="module")
def sizeable(tmp_path_factory):
    folder = build(SIZEABLE, tmp_path_factory.mktemp("sizeable"))
    with LLM(str(folder), kv_cache_bytes=8 * MiB, max_model_len=256, enable_sleep_mode=True) as llm:
        yield llm


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_gives_identical_outputs_and_frees_memory(sizeable, level):
    before = token_ids(sizeable.generate(PROMPTS, GREEDY))
    tags = sizeable.memory_stats()["tags"]
    weights, kv = tags["weights"]["reserved_bytes"], tags["kv_cache"]["reserved_bytes"]
    # The KV cache holds only the pages its requests used since the last wake (all of them at
    # start): that is what a sleep can free.
    kv_held = tags["kv_cache"]["resident_bytes"]
    assert weights >= 32 * MiB and 0 < kv_held <= kv
    # One definition of released (the ACK, the metric, the console): what a sleep gave back;
    # awake, nothing is (after a wake, KV pages no request has touched are just not resident).
    assert sizeable.memory_stats()["released_bytes"] == 0
    rss_before = process_resident_bytes()
    (ack,) = sizeable.sleep(level=level)
    rss_drop = rss_before - process_resident_bytes()
    stats = sizeable.memory_stats()
    assert sizeable.is_sleeping() and stats["resident_bytes"] == 0
    assert stats["released_bytes"] == stats["reserved_bytes"] == weights + kv
    if level == 1:  # weights moved to a host copy: on the CPU only the KV cache leaves RSS
        assert stats["backup_bytes"] == ack["metadata"]["host_backup_bytes"] == weights
        assert 0.9 * kv_held <= rss_drop < kv + weights / 2
    else:
        assert stats["backup_bytes"] == 0
        assert rss_drop >= 0.9 * (weights + kv_held)
    (wake,) = sizeable.wake_up()
    assert wake["status"] == "SUCCESS" and not sizeable.is_sleeping()
    awake = sizeable.memory_stats()
    assert awake["released_bytes"] == 0 and awake["resident_bytes"] < awake["reserved_bytes"]
    assert token_ids(sizeable.generate(PROMPTS, GREEDY)) == before


# -- the Python API keeps the server's names, defaults and words ----------------------------


def test_keywords_and_defaults_are_the_servers(demo):
    import inspect

    from omnistage.config import StageConfig
    from omnistage.entrypoints.openai.server_config import ServerConfig

    defaults = {k: p.default for k, p in inspect.signature(LLM).parameters.items()}
    assert defaults["enable_sleep_mode"] is ServerConfig.model_fields["enable_sleep_mode"].default
    assert defaults["dtype"] == StageConfig.model_fields["dtype"].default == "auto"
    assert defaults["device"] == StageConfig.model_fields["device"].default
    assert "kv_cache_memory" in defaults and "kv_cache_memory" in ServerConfig.model_fields
    with LLM(str(demo), kv_cache_memory="4MiB", max_model_len=256) as llm:
        assert llm.memory_stats()["tags"]["kv_cache"]["reserved_bytes"] <= 4 * MiB
        assert not llm.engine.config.enable_sleep_mode
        with pytest.raises(SleepModeDisabledError) as info:
            llm.sleep()
    assert "enable_sleep_mode=True" in str(info.value) and "--" not in str(info.value)
    with pytest.raises(TypeError, match="kv_cache_memory and kv_cache_bytes"):
        LLM(str(demo), kv_cache_memory="4MiB", kv_cache_bytes=4 * MiB)
    with pytest.raises(ConfigError, match="raise kv_cache_memory") as too_small:
        LLM(str(demo), kv_cache_memory="1MiB")
    assert "--" not in str(too_small.value)


def test_n_samples_with_logprobs_on_a_fresh_llm(demo):
    params = SamplingParams(n=4, logprobs=3, prompt_logprobs=0, seed=5, max_tokens=6)
    with LLM(str(demo), kv_cache_memory="4MiB", max_model_len=256) as fresh:
        (out,) = fresh.generate("Hello there", params)
        assert out.finished and [s.index for s in out.outputs] == [0, 1, 2, 3]
        for sample in out.outputs:
            assert len(sample.logprobs) == len(sample.token_ids) and sample.finish_reason
            for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
                assert token in entry and {1, 2, 3} <= {e.rank for e in entry.values()}
                assert all(
                    e.logprob <= 0 and isinstance(e.decoded_token, str) for e in entry.values()
                )
            assert sample.cumulative_logprob < 0
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]
        # Seeded: the same answer again, and one SamplingParams per prompt.
        again = fresh.generate(["Hello there", "Hello there"], [params, SamplingParams(n=2)])
        assert [s.token_ids for s in again[0].outputs] == [s.token_ids for s in out.outputs]
        assert len(again[1].outputs) == 2 and again[1].outputs[0].logprobs is None


def test_sleep_of_the_kv_cache_keeps_the_weights(llm):
    before = token_ids(llm.generate(PROMPTS, GREEDY))
    (ack,) = llm.sleep(level=1, tags=["kv_cache"])
    assert ack["status"] == "SUCCESS" and llm.is_sleeping()
    tags = llm.memory_stats()["tags"]
    assert tags["kv_cache"]["is_asleep"] and not tags["weights"]["is_asleep"]
    with pytest.raises(StageAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        llm.sleep(level=1, tags=["kv-cache"])
    assert info.value.field == "tags"
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and token_ids(llm.generate(PROMPTS, GREEDY)) == before
    assert llm.reset_prefix_cache() is True
    assert llm.collective_rpc(lambda worker, k: (type(worker).__name__, k), args=(3,)) == [
        ("ARWorker", 3)
    ]
    with pytest.raises(TypeError, match="callable"):
        llm.collective_rpc("sleep")  # type: ignore[arg-type]


def test_vllms_arguments_are_taken_or_refused_saying_why(demo, capsys):
    """RL frameworks pass these routinely; each was a bare TypeError."""
    with LLM(
        str(demo), kv_cache_bytes=4 * MiB, max_model_len=256, seed=0,
        enforce_eager=True, trust_remote_code=True, disable_log_stats=True,
        tokenizer=str(demo), load_format="auto",
    ) as llm:  # fmt: skip
        assert llm.engine.config.ar.enforce_eager
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
        assert len(outputs) == 3 and "Processed prompts" in capsys.readouterr().err
        assert llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
        assert llm.generate("hi", SamplingParams(n=2, best_of=2, max_tokens=2))
        with pytest.raises(TypeError, match="lora_request: LoRA adapters are not served yet"):
            llm.generate("hi", GREEDY, lora_request=object())
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            llm.generate("hi", GREEDY, bogus=1)
    with pytest.raises(InvalidRequestError, match="best_of") as refused:
        SamplingParams(n=1, best_of=4)
    assert "returns every sample" in str(refused.value)
    for name, value, why in [
        ("quantization", "awq", "not served yet"),
        ("swap_space", 4, "recomputes"),
        ("load_format", "dummy", "safetensors"),
        ("tokenizer", "/elsewhere", "the checkpoint's own"),
    ]:
        with pytest.raises(TypeError, match=f"does not take {name}=.*{why}"):
            LLM(str(demo), **{name: value})
