"""A real (tiny) RL post-training loop with omnistage as its rollout engine.

A trainer in plain torch holds the same model a stage serves. Each step it:

1. rolls out ``n = 4`` sampled answers with logprobs per prompt (one request each, the prompt
   prefilled once), rewards them, and takes a policy-gradient step on them;
2. sleeps the stage's KV cache (the weights stay: nothing is loaded twice);
3. pushes the new weights without disk (gloo on CPU, NCCL on GPU) — ``omnistage.rl``;
4. wakes the KV cache (the stage resumes), and checks that omnistage now computes exactly
   the trainer's log-probabilities (prompt logprobs of a fixed text, within 1e-4) and that
   the weights checksums agree.

Run: ``python examples/rl_loop.py`` (builds a tiny model and starts a server), or point it at
a server you started yourself: ``--url http://127.0.0.1:8000 --model DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from omnistage.rl import WeightSender, weights_checksum

PROMPTS = ["Tell me a story.", "What is 2 + 2?", "Name a colour."]
FIXED = "The quick brown fox jumps over the lazy dog."
SAMPLES, NEW_TOKENS, LEARNING_RATE = 4, 8, 1e-2


@contextlib.contextmanager
def tiny_server(model: Path) -> Iterator[str]:
    """``omnistage serve --model MODEL`` on a free port, for as long as the loop runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "omnistage.cli", "serve", "--model", str(model),
           "--enable-sleep-mode", "--port", str(port)]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if process.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def tiny_model(folder: Path) -> Path:
    """omnistage's deterministic tiny Qwen2 (random weights, its own tokenizer)."""
    from omnistage.models.tiny import build_preset

    return build_preset("demo", folder)


def rollouts(
    http: httpx.Client, prompts: list[list[int]], step: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, sampled ids) of every sample of every prompt."""
    out = []
    for i, prompt in enumerate(prompts):
        reply = http.post("/v1/completions", json={
            "prompt": prompt, "n": SAMPLES, "max_tokens": NEW_TOKENS, "temperature": 1.0,
            "seed": 1000 * step + i, "logprobs": 0, "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        })  # fmt: skip
        reply.raise_for_status()
        for choice in reply.json()["choices"]:
            tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            out.append((prompt, tokens))
    return out


def reward(tokens: list[int]) -> float:
    """A toy reward: prefer even token ids (anything learnable will do)."""
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list) -> float:
    rewards = torch.tensor([reward(tokens) for _, tokens in batch])
    advantages = rewards - rewards.mean()
    loss = torch.zeros(())
    for (prompt, tokens), advantage in zip(batch, advantages, strict=True):
        ids = torch.tensor([prompt + tokens])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])
        loss = loss - advantage * chosen.sum()
    optimizer.zero_grad()
    (loss / len(batch)).backward()
    optimizer.step()
    return float(rewards.mean())


def check_logprobs(http: httpx.Client, model: torch.nn.Module, ids: list[int]) -> float:
    """Largest gap between omnistage's and the trainer's logprobs of ``ids``."""
    reply = http.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    )
    reply.raise_for_status()
    served = reply.json()["choices"][0]["prompt_logprobs"]
    with torch.no_grad():
        mine = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return max(
        abs(served[j][str(ids[j])]["logprob"] - mine[j - 1, ids[j]].item())
        for j in range(1, len(ids))
    )


def control(http: httpx.Client, path: str, body: dict) -> None:
    reply = http.post(path, json=body)
    reply.raise_for_status()
    assert reply.json().get("status") in ("SUCCESS", "SKIPPED", None), reply.text


def run(url: str, model_dir: Path, steps: int) -> None:
    import transformers

    from omnistage.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    fixed = tokenizer.encode(FIXED)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    with (
        httpx.Client(base_url=url, timeout=120) as http,
        WeightSender(url, backend="nccl") as sender,
    ):
        sender.init()
        for step in range(steps):
            start = time.perf_counter()
            batch = rollouts(http, prompts, step)
            mean_reward = train_step(model, optimizer, batch)
            control(http, "/v1/omni/sleep", {"stage_ids": [0], "level": 1, "tags": ["kv_cache"]})
            ack = sender.send(model.state_dict().items(), weight_version=step + 1)
            control(http, "/v1/omni/wakeup", {"stage_ids": [0], "tags": ["kv_cache"]})
            gap = check_logprobs(http, model, fixed)
            same = sender.remote_checksum() == weights_checksum(model.state_dict().items())
            print(f"step {step + 1}: reward {mean_reward:.3f}, {len(batch)} samples, sync "
                  f"{ack['metadata']['latency_ms']:.0f} ms, logprob gap {gap:.2e}, "
                  f"checksums {'agree' if same else 'DIFFER'}, {time.perf_counter() - start:.1f} s")  # fmt: skip
            assert gap <= 1e-4, f"omnistage's logprobs differ from the trainer's by {gap}"
            assert same, "the served weights are not the trainer's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running omnistage server (else one is started)")
    parser.add_argument("--model", type=Path, help="its model folder (with --url)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        if args.model is None:
            parser.error("--url needs --model: the trainer loads the same checkpoint")
        run(args.url, args.model, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp) / "model")
        with tiny_server(model_dir) as url:
            run(url, model_dir, args.steps)


if __name__ == "__main__":
    main()
