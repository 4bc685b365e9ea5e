import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage import LLM, RequestOutput, SamplingParams
from omnistage.errors import InvalidRequestError, StageAsleepError, WeightsInvalidError
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
    with LLM(str(demo), kv_cache_bytes=4 * MiB, max_model_len=256, seed=0) as llm:
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
    with LLM(str(folder), kv_cache_bytes=8 * MiB, max_model_len=256) as llm:
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
    rss_before = process_resident_bytes()
    (ack,) = sizeable.sleep(level=level)
    rss_drop = rss_before - process_resident_bytes()
    stats = sizeable.memory_stats()
    assert sizeable.is_sleeping() and stats["resident_bytes"] == 0
    if level == 1:  # weights moved to a host copy: on the CPU only the KV cache leaves RSS
        assert stats["backup_bytes"] == ack["metadata"]["host_backup_bytes"] == weights
        assert 0.9 * kv_held <= rss_drop < kv + weights / 2
    else:
        assert stats["backup_bytes"] == 0
        assert rss_drop >= 0.9 * (weights + kv_held)
    (wake,) = sizeable.wake_up()
    assert wake["status"] == "SUCCESS" and not sizeable.is_sleeping()
    assert token_ids(sizeable.generate(PROMPTS, GREEDY)) == before
