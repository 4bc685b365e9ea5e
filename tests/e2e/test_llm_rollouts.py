"""The offline ``LLM`` as an in-process rollout engine: ``n`` seeded samples with logprobs
equal transformers' on the same checkpoint, and — token for token, logprob for logprob — the
answer a server started with the same settings gives the same request over HTTP."""

from __future__ import annotations

import httpx
import pytest
import torch

from omnistage import LLM, RequestOutput, SamplingParams
from omnistage.models.tiny import build_preset
from tests.e2e.server import running_server

SEED, N, NEW_TOKENS, TOP = 1234, 4, 8, 2
# The same settings in the server's flags and LLM's keywords (the same names).
SETTINGS = {"max_model_len": 256, "kv_cache_memory": "8MiB"}
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_preset("demo", tmp_path_factory.mktemp("rollouts"))


@pytest.fixture(scope="module")
def llm(model):
    with LLM(str(model), **SETTINGS) as llm:  # type: ignore[arg-type]
        yield llm


@pytest.fixture(scope="module")
def server(model):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    with running_server("--model", str(model), *flags) as server:
        yield server


@pytest.fixture(scope="module")
def reference(model):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().encode("The quick brown fox jumps over")


@pytest.fixture(scope="module")
def rollout(llm, prompt) -> RequestOutput:
    params = SamplingParams(
        n=N, logprobs=TOP, prompt_logprobs=TOP, seed=SEED, temperature=1.0,
        max_tokens=NEW_TOKENS, ignore_eos=True,
    )  # fmt: skip
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    return out


def log_softmax(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_n_seeded_samples_with_logprobs_equal_transformers(rollout, prompt, reference):
    assert rollout.finished and [s.index for s in rollout.outputs] == list(range(N))
    assert len({tuple(s.token_ids) for s in rollout.outputs}) > 1  # sampled, not copies
    for sample in rollout.outputs:
        assert len(sample.token_ids) == NEW_TOKENS == len(sample.logprobs)
        assert sample.finish_reason == "length"
        expected = log_softmax(reference, prompt + sample.token_ids)[len(prompt) - 1 : -1]
        for row, token, entry in zip(expected, sample.token_ids, sample.logprobs, strict=True):
            assert abs(entry[token].logprob - row[token].item()) <= 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, TOP)
            ranked = sorted((e.rank, t) for t, e in entry.items() if e.rank <= TOP)
            assert [t for _, t in ranked] == top.indices.tolist()
            for t, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[t].logprob - value) <= 1e-4
        total = sum(
            entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs, strict=True)
        )
        assert sample.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_equal_transformers(rollout, prompt, reference):
    expected = log_softmax(reference, prompt)
    assert rollout.prompt_token_ids == prompt
    assert rollout.prompt_logprobs[0] is None and len(rollout.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = rollout.prompt_logprobs[j]
        assert abs(entry[prompt[j]].logprob - expected[j - 1, prompt[j]].item()) <= 1e-4


def test_sample_i_is_the_single_sample_with_seed_plus_i(llm, rollout, prompt):
    for sample in rollout.outputs:
        params = SamplingParams(
            seed=SEED + sample.index, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0
        )
        (single,) = llm.generate({"prompt_token_ids": prompt}, params)
        assert single.outputs[0].token_ids == sample.token_ids


def test_the_same_request_over_http_answers_the_same(server, rollout, prompt):
    body = {
        "prompt": prompt, "n": N, "logprobs": TOP, "prompt_logprobs": TOP, "seed": SEED,
        "temperature": 1.0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == N
    for choice, sample in zip(choices, rollout.outputs, strict=True):
        served = choice["logprobs"]
        assert [int(t.removeprefix("token_id:")) for t in served["tokens"]] == sample.token_ids
        assert choice["text"] == sample.text and choice["finish_reason"] == sample.finish_reason
        for token, value, top, entry in zip(
            sample.token_ids, served["token_logprobs"], served["top_logprobs"], sample.logprobs,
            strict=True,
        ):  # fmt: skip
            assert value == pytest.approx(entry[token].logprob, abs=1e-6)
            assert {int(k.removeprefix("token_id:")) for k in top} == set(entry)
        prompt_entries = choice["prompt_logprobs"]
        assert prompt_entries[0] is None
        for served_entry, entry in zip(
            prompt_entries[1:], rollout.prompt_logprobs[1:], strict=True
        ):
            assert {int(k): v["logprob"] for k, v in served_entry.items()} == pytest.approx(
                {t: e.logprob for t, e in entry.items()}, abs=1e-6
            )


def test_chat_equals_the_chat_route(server, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    (out,) = llm.chat(CHAT, greedy)
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": CHAT, "temperature": 0.0, "max_tokens": NEW_TOKENS},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == out.outputs[0].text
    assert reply.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
