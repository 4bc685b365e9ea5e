"""The RL surface over HTTP with the official openai client: logprobs (chat and completions,
streamed too), n samples, prefix-cache reset and abort by id."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import CONTROL_KEY

CONTROL = {"Authorization": f"Bearer {CONTROL_KEY}"}


@pytest.fixture(scope="module")
def client(omni_server):
    return openai.OpenAI(base_url=omni_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_in_openais_shape(client):
    reply = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0.0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the top


def test_completion_n_samples_with_logprobs_and_prompt_logprobs(client, omni_server):
    reply = client.completions.create(
        model="tiny-omni", prompt="Once upon", max_tokens=6, n=3, temperature=1.0, seed=11,
        logprobs=2, extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1
    for choice in reply.choices:
        assert len(choice.logprobs.tokens) == 6 == len(choice.logprobs.token_logprobs)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    raw = httpx.post(
        omni_server.url + "/v1/completions",
        json={"prompt": "Once upon", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 11,
              "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True},
        timeout=60,
    ).json()  # fmt: skip
    assert [c["text"] for c in raw["choices"]] == [c.text for c in reply.choices]  # seeded
    prompt = raw["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and all(entry for entry in prompt[1:])


def test_streamed_chat_carries_logprobs_per_choice(client):
    stream = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        temperature=1.0, seed=3, logprobs=True, stream=True,
    )  # fmt: skip
    tokens: dict[int, int] = {}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                tokens[choice.index] = tokens.get(choice.index, 0) + len(choice.logprobs.content)
            if choice.finish_reason:
                finished.add(choice.index)
    assert tokens == {0: 4, 1: 4} and finished == {0, 1}


def test_prefix_cache_reset_and_hit_rate(omni_server):
    long_prompt = "the same long system prompt " * 20
    for _ in range(2):
        httpx.post(
            omni_server.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}
        )
    stages = httpx.get(omni_server.url + "/v1/omni/stages", headers=CONTROL).json()["stages"]
    assert stages[0]["prefix_cache"]["hit_tokens"] > 0
    metrics = httpx.get(omni_server.url + "/metrics").text
    hits = [
        line
        for line in metrics.splitlines()
        if line.startswith("omnistage:prefix_cache_hits_total{") and 'stage="0"' in line
    ]
    assert len(hits) == 1 and float(hits[0].split()[-1]) > 0
    reset = httpx.post(omni_server.url + "/v1/omni/reset_prefix_cache", headers=CONTROL)
    assert reset.status_code == 200 and reset.json()["stage_ids"] == [0]
    stages = httpx.get(omni_server.url + "/v1/omni/stages", headers=CONTROL).json()["stages"]
    assert stages[0]["prefix_cache"]["cached_blocks"] == 0
    assert httpx.post(omni_server.url + "/reset_prefix_cache", headers=CONTROL).status_code == 200


def test_abort_by_id_ends_a_running_request(omni_server):
    body = {"prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
    outcome: dict[str, object] = {}

    def run() -> None:
        with httpx.stream("POST", omni_server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    outcome.setdefault("id", line.split('"id": "')[1].split('"')[0])
                    if '"finish_reason": "abort"' in line:
                        outcome["reason"] = "abort"

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while "id" not in outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    reply = httpx.post(
        omni_server.url + "/v1/omni/abort", json={"request_ids": [outcome["id"]]}, headers=CONTROL
    )
    assert reply.status_code == 200
    worker.join(30)
    assert outcome.get("reason") == "abort"
