"""TRL's own vLLM client (``trl.generation.vllm_client.VLLMClient``, what ``GRPOTrainer``
uses in server mode) against ``omnistage serve``: every rollout call it makes works, field by
field, with logprobs equal to transformers' on the same checkpoint within 1e-4; the weight
push TRL cannot make without vLLM goes through ``omnistage.rl.WeightSender`` (docs/rl.md).
Also here: the vLLM development routes RL clients call, and vLLM's status codes."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from tests.e2e.server import running_server

vllm_client = pytest.importorskip("trl.generation.vllm_client")
transformers = pytest.importorskip("transformers")

NAME = "policy"
TOL = 1e-4
# A template of the request's own: the tools, the messages and a template variable, in
# plain text (the checkpoint's own template renders no tools).
TEMPLATE = (
    "{% for tool in tools %}[tool {{ tool.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{{ mood }}{% endif %}"
)


def lookup(city: str) -> str:
    """Look a city up.

    Args:
        city: The city's name.
    """
    return city


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return ensure_preset("demo", cache_dir() / "demo")


@pytest.fixture(scope="module")
def loading(checkpoint):
    """transformers' model of the checkpoint, loaded while the server starts."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(
            lambda: transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32
            ).eval()
        )


@pytest.fixture(scope="module")
def server(checkpoint, loading):
    with running_server(
        str(checkpoint), "--served-model-name", NAME, "--max-model-len", "512",
        "--kv-cache-memory", "32MiB", "--enable-sleep-mode", "--trust-request-chat-template",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server):
    # TRL refuses to build its client unless vLLM is installed on the trainer's side, though
    # everything but its weight push speaks plain HTTP.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
        yield vllm_client.VLLMClient(base_url=server.url, connection_timeout=30)


@pytest.fixture(scope="module")
def model(loading):
    return loading.result()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


_REFERENCES: dict[tuple[int, ...], torch.Tensor] = {}  # cleared when the weights change


def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids`` (row p predicts ``ids[p + 1]``)."""
    if tuple(ids) not in _REFERENCES:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        _REFERENCES[tuple(ids)] = torch.log_softmax(logits, dim=-1)
    return _REFERENCES[tuple(ids)]


def assert_rollout_logprobs(model, prompt_ids, completion_ids, logprobs, logprob_token_ids):
    """Each position's logprobs (the sampled token's and the top ones, as TRL sorts them)
    equal transformers'; the sampled token is among them."""
    expected = reference(model, prompt_ids + completion_ids)
    for k, token in enumerate(completion_ids):
        row = expected[len(prompt_ids) + k - 1]
        assert token in logprob_token_ids[k]
        for token_id, logprob in zip(logprob_token_ids[k], logprobs[k], strict=True):
            assert abs(logprob - row[token_id].item()) < TOL


def test_check_server_and_world_size(client):
    client.check_server(total_timeout=5)
    assert client.model == NAME
    assert client.get_world_size() == 1


def test_generate_text_prompts_n2(client, model, tokenizer):
    prompts = ["Once upon a time", "hi"]
    out = client.generate(
        prompts, n=2, max_tokens=6, logprobs=0, generation_kwargs={"seed": 7, "ignore_eos": True}
    )
    assert out["prompt_ids"] == [tokenizer(p)["input_ids"] for p in prompts]
    assert len(out["completion_ids"]) == 4 and all(len(c) == 6 for c in out["completion_ids"])
    assert out["completion_ids"][0] != out["completion_ids"][1]  # two samples, not one twice
    for i, completion in enumerate(out["completion_ids"]):  # prompt-major: i // n
        assert all(len(ids) == 1 for ids in out["logprob_token_ids"][i])
        assert_rollout_logprobs(
            model, out["prompt_ids"][i // 2], completion, out["logprobs"][i],
            out["logprob_token_ids"][i],
        )  # fmt: skip


def test_generate_token_prompts_greedy_is_transformers_argmax(client, model):
    prompts = [[11, 22, 33, 44], [5, 6, 7]]
    out = client.generate(prompts, n=2, temperature=0.0, max_tokens=5, logprobs=0,
                          generation_kwargs={"ignore_eos": True})  # fmt: skip
    assert out["prompt_ids"] == prompts
    for i, completion in enumerate(out["completion_ids"]):
        expected = reference(model, prompts[i // 2] + completion)
        start = len(prompts[i // 2]) - 1
        # greedy: each token is transformers' most likely after the ones before it
        assert completion == expected[start : start + len(completion)].argmax(-1).tolist()
        assert_rollout_logprobs(
            model, prompts[i // 2], completion, out["logprobs"][i], out["logprob_token_ids"][i]
        )


def test_chat_n2_with_top_logprobs(client, model, tokenizer):
    messages = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "why"}]]
    out = client.chat(messages, n=2, max_tokens=5, logprobs=2,
                      generation_kwargs={"seed": 3, "ignore_eos": True})  # fmt: skip
    for conversation, prompt_ids in zip(messages, out["prompt_ids"], strict=True):
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        assert prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(out["completion_ids"]) == 4
    for i, completion in enumerate(out["completion_ids"]):
        expected = reference(model, out["prompt_ids"][i // 2] + completion)
        for k, ids in enumerate(out["logprob_token_ids"][i]):
            top2 = expected[len(out["prompt_ids"][i // 2]) + k - 1].topk(2).indices.tolist()
            assert set(top2) <= set(ids) and len(ids) in (2, 3)  # the top 2, and the sample
        assert_rollout_logprobs(
            model, out["prompt_ids"][i // 2], completion, out["logprobs"][i],
            out["logprob_token_ids"][i],
        )  # fmt: skip


def test_chat_renders_tools_template_and_its_variables(client, tokenizer):
    messages = [[{"role": "user", "content": "weather in Oslo?"}]]
    out = client.chat(messages, max_tokens=2, tools=[lookup], chat_template=TEMPLATE,
                      chat_template_kwargs={"mood": "calm"})  # fmt: skip
    expected = "[tool lookup]<user>weather in Oslo?<assistant>calm"
    assert out["prompt_ids"] == [tokenizer(expected, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"chat_template": "{% for %}"}, "chat_template"),
    ],
)
def test_chat_extensions_omnistage_does_not_implement_are_400s(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_conversation_with_tool_calls_reaches_the_template(server, tokenizer):
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}"
        "{{ m.tool_call_id or '' }};{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
    ]
    body = {"messages": messages, "max_tokens": 1, "chat_template": template,
            "return_token_ids": True}  # fmt: skip
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    expected = "user:Oslo?;assistant:[lookup];tool:rainc1;"
    assert reply.json()["prompt_token_ids"] == tokenizer(expected)["input_ids"]


def test_a_streamed_batch_is_prompt_major_with_token_ids(server):
    body = {"prompt": [[11, 22, 33], [5, 6]], "n": 2, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as reply:  # fmt: skip
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for choice in whole["choices"]:
        streamed = [c for c in chunks if c["index"] == choice["index"]]
        assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert sum((c.get("token_ids", []) for c in streamed), []) == choice["token_ids"]
        assert "".join(c["text"] for c in streamed) == choice["text"]
    assert whole["choices"][2]["prompt_token_ids"] == [5, 6]
    mixed = httpx.post(server.url + "/v1/completions", json={"prompt": ["hi", [1, 2]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"


def test_get_sequence_logprobs(client, model):
    sequences, prompt_lengths = [[11, 22, 33, 44, 55, 66], [7, 8, 9, 10]], [3, 1]
    out = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=5)
    for b, (sequence, start) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        expected = reference(model, sequence)
        assert len(out["actual_logprobs"][b]) == len(sequence) - start
        for k, position in enumerate(range(start, len(sequence))):
            row = expected[position - 1]
            top = row.topk(5)
            assert out["logprob_token_ids"][b][k] == top.indices.tolist()
            assert max(abs(a - e) for a, e in zip(out["logprobs"][b][k], top.values.tolist(), strict=True)) < TOL  # fmt: skip
            assert out["actual_token_ids"][b][k] == [sequence[position]]
            assert abs(out["actual_logprobs"][b][k][0] - row[sequence[position]].item()) < TOL


def test_reset_prefix_cache_answers_success(client, server, monkeypatch):
    client.reset_prefix_cache()  # TRL before vLLM 0.26: the status only
    monkeypatch.setattr(vllm_client, "_HAS_RESET_PREFIX_CACHE_SUCCESS", True)
    client.reset_prefix_cache()
    reply = httpx.post(server.url + "/reset_prefix_cache?reset_running_requests=true", timeout=30)
    assert reply.status_code == 200 and reply.json()["success"] is True


def test_server_info_as_trl_reads_it(client):
    info = client.get_server_info()
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    assert info["parallel_config"]["world_size"] == 1
    assert info["model_config"]["served_model_name"] == NAME
    assert info["model_config"]["max_model_len"] == 512
    # the text stage's own settings (the defaults: no flag sets them here)
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs"
    assert info["cache_config"] == {"block_size": 16, "enable_prefix_caching": True}
    assert info["scheduler_config"] == {"max_num_seqs": 32, "max_num_batched_tokens": 2048}


def test_vllm_status_codes(server, checkpoint):
    url = server.url
    for path, body in [
        ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    ]:  # fmt: skip
        reply = httpx.post(url + path, json=body, timeout=30)
        assert reply.status_code == 404
        assert reply.json()["error"] == {
            "message": "The model `gpt-4o` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404,
        }  # fmt: skip
    by_path = {"model": str(checkpoint), "prompt": "hi", "max_tokens": 1}
    reply = httpx.post(url + "/v1/completions", json=by_path, timeout=30)
    assert reply.status_code == 200 and reply.json()["model"] == NAME
    long = httpx.post(url + "/v1/completions", json={"prompt": [[1] * 600], "max_tokens": 1})
    assert long.status_code == 400, long.text
    error = long.json()["error"]
    assert error["param"] == "prompt.0" and error["code"] == "context_length_exceeded"
    assert (
        "maximum context length is 512 tokens. However, you requested 600 tokens"
        in (error["message"])
    )
    regex = {"prompt": "hi", "structured_outputs": {"regex": "a+"}}
    reply = httpx.post(url + "/v1/completions", json=regex, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs"


def test_collective_rpc_subset(server):
    rpc = server.url + "/collective_rpc"
    for method in ("check_health", "reset_prefix_cache", "reload_weights"):
        reply = httpx.post(rpc, json={"method": method}, timeout=60)
        assert reply.status_code == 200 and reply.json() == {"results": [None]}, reply.text
    reply = httpx.post(rpc, json={"method": "report_device_id"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "method"


def test_release_kv_cache_memory_as_vllm_documents_it(server):
    url = server.url

    def post(path: str) -> httpx.Response:
        reply = httpx.post(url + path, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply

    bogus = httpx.post(url + "/release_kv_cache_memory", json={"bogus": 1}, timeout=30)
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "bogus", bogus.text
    post("/sleep?level=0&mode=keep")  # pause, release nothing
    (stage,) = httpx.get(url + "/v1/omni/stages", timeout=30).json()["stages"]
    assert stage["level"] == 0 and stage["sleeping_tags"] == []
    ack = post("/release_kv_cache_memory").json()["acks"][0]
    assert ack["metadata"]["sleeping_tags"] == ["kv_cache"] and ack["freed_bytes"] > 0
    again = httpx.post(url + "/release_kv_cache_memory", timeout=30)
    assert again.status_code == 409  # its memory is not resident any more
    post("/wake_up?tags=kv_cache")
    reply = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_version_flag():
    from omnistage import __version__

    done = subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == __version__


def test_trls_packed_weight_push_is_refused_naming_it(server):
    reply = httpx.post(
        server.url + "/init_weight_transfer_engine",
        json={"init_info": {"master_address": "127.0.0.1", "master_port": 1, "packed": True}},
        timeout=30,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "init_info.packed"
    reply = httpx.post(server.url + "/shutdown_weight_transfer_engine", timeout=30)
    assert reply.json() == {"status": "SUCCESS", "aborted_session": False}


class OmnistageVLLMClient(vllm_client.VLLMClient):
    """docs/rl.md's TRL client: its weight push through ``omnistage.rl.WeightSender``."""

    def init_communicator(self, device=0):
        from omnistage.rl import WeightSender

        self.sender = WeightSender(self.base_url, backend="ipc")  # "nccl": gloo on CPU
        self.sender.init()
        self.pending = None

    def _start_weight_update(self):
        self.pending = []

    def _finish_weight_update(self):
        pending, self.pending = self.pending, None
        self.sender.send(pending)

    def update_named_params(self, metadata, named_params):
        tensors = [(name, tensor.detach()) for name, tensor in named_params]
        if self.pending is not None:
            self.pending.extend(tensors)
        else:
            self.sender.send(tensors)

    def close_communicator(self):
        self.sender.close()


def test_trls_weight_push_through_weight_sender_serves_the_new_weights(client, server, model):
    """docs/rl.md: TRL for rollouts, ``WeightSender`` for the weights (last: it changes them)."""
    from omnistage.rl import weights_checksum

    generator = torch.Generator().manual_seed(0)
    _REFERENCES.clear()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
        trainer_side = OmnistageVLLMClient(base_url=server.url)
    trainer_side.init_communicator()
    trainer_side.update_model_params(model)  # what GRPOTrainer's sync does, in one call
    with trainer_side.weight_update():  # what TRL's online DPO does, tensor by tensor
        for name, param in model.named_parameters():
            trainer_side.update_named_param(name, param.data)
    assert trainer_side.sender.remote_checksum() == weights_checksum(
        (name, p.detach()) for name, p in model.named_parameters()
    )
    trainer_side.close_communicator()
    out = client.generate([[11, 22, 33]], max_tokens=4, logprobs=0,
                          generation_kwargs={"seed": 1, "ignore_eos": True})  # fmt: skip
    assert_rollout_logprobs(
        model, [11, 22, 33], out["completion_ids"][0], out["logprobs"][0],
        out["logprob_token_ids"][0],
    )  # fmt: skip
