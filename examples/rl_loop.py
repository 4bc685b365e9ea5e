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

``--in-process`` runs the same loop with the rollout engine in the trainer's process, as verl
and OpenRLHF drive vLLM's ``LLM``: ``omnistage.LLM`` rolls out, sleeps its KV cache, takes
the trainer's state dict in place (``update_weights``, no transfer at all) and wakes. Each
step also checks that the rollouts' logprobs are the trainer's own (on-policy, within 1e-4).
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
from typing import Any

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


Sample = tuple[list[int], list[int], list[float]]  # prompt ids, sampled ids, their logprobs


def rollouts(http: httpx.Client, prompts: list[list[int]], step: int) -> list[Sample]:
    """Every sample of every prompt, over HTTP."""
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
            out.append((prompt, tokens, choice["logprobs"]["token_logprobs"]))
    return out


def rollouts_in_process(llm: Any, prompts: list[list[int]], step: int) -> list[Sample]:
    """The same samples from ``omnistage.LLM`` (one call, one seed per prompt)."""
    from omnistage import SamplingParams

    params = [
        SamplingParams(n=SAMPLES, max_tokens=NEW_TOKENS, temperature=1.0,
                       seed=1000 * step + i, logprobs=0, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        (
            out.prompt_token_ids,
            s.token_ids,
            [s.logprobs[j][t].logprob for j, t in enumerate(s.token_ids)],
        )
        for out in outputs
        for s in out.outputs
    ]


def reward(tokens: list[int]) -> float:
    """A toy reward: prefer even token ids (anything learnable will do)."""
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list[Sample]
) -> tuple[float, float]:
    """One policy-gradient step; the mean reward, and the largest gap between the rollout
    engine's logprobs and the trainer's for the sampled tokens (on-policy: ~0)."""
    rewards = torch.tensor([reward(tokens) for _, tokens, _ in batch])
    advantages = rewards - rewards.mean()
    loss = torch.zeros(())
    gap = 0.0
    for (prompt, tokens, sampled), advantage in zip(batch, advantages, strict=True):
        ids = torch.tensor([prompt + tokens])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])
        gap = max(gap, (chosen[:, 0].detach() - torch.tensor(sampled)).abs().max().item())
        loss = loss - advantage * chosen.sum()
    optimizer.zero_grad()
    (loss / len(batch)).backward()
    optimizer.step()
    return float(rewards.mean()), gap


def check_logprobs(http: httpx.Client, model: torch.nn.Module, ids: list[int]) -> float:
    """Largest gap between omnistage's and the trainer's logprobs of ``ids``."""
    reply = http.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    )
    reply.raise_for_status()
    served = reply.json()["choices"][0]["prompt_logprobs"]
    by_id = [None] + [{int(t): e["logprob"] for t, e in entry.items()} for entry in served[1:]]
    return gap_to(by_id, model, ids)


def gap_to(served: list, model: torch.nn.Module, ids: list[int]) -> float:
    """Largest gap between served prompt logprobs (token id -> logprob) and the trainer's."""
    with torch.no_grad():
        mine = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return max(abs(served[j][ids[j]] - mine[j - 1, ids[j]].item()) for j in range(1, len(ids)))


def report(step: int, start: float, samples: int, **values: Any) -> None:
    """One line per step (what CI reads), and the step's checks."""
    print(f"step {step + 1}: reward {values['reward']:.3f}, {samples} samples, rollout logprob "
          f"gap {values['rollout_gap']:.2e}, sync {values['sync_ms']:.0f} ms, logprob gap "
          f"{values['gap']:.2e}, checksums {'agree' if values['same'] else 'DIFFER'}, "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    assert values["rollout_gap"] <= 1e-4, "the rollouts' logprobs are not the trainer's"
    assert values["gap"] <= 1e-4, (
        f"omnistage's logprobs differ from the trainer's by {values['gap']}"
    )
    assert values["same"], "the served weights are not the trainer's"


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
            mean_reward, rollout_gap = train_step(model, optimizer, batch)
            control(http, "/v1/omni/sleep", {"stage_ids": [0], "level": 1, "tags": ["kv_cache"]})
            ack = sender.send(model.state_dict().items(), weight_version=step + 1)
            control(http, "/v1/omni/wakeup", {"stage_ids": [0], "tags": ["kv_cache"]})
            report(
                step, start, len(batch), reward=mean_reward, rollout_gap=rollout_gap,
                sync_ms=ack["metadata"]["latency_ms"], gap=check_logprobs(http, model, fixed),
                same=sender.remote_checksum() == weights_checksum(model.state_dict().items()),
            )  # fmt: skip


def run_in_process(model_dir: Path, steps: int) -> None:
    """The loop with ``omnistage.LLM`` in this process: no server, no transfer."""
    import transformers

    from omnistage import LLM, SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    with LLM(str(model_dir), enable_sleep_mode=True, max_model_len=256,
             kv_cache_memory="16MiB") as llm:  # fmt: skip
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        fixed = tokenizer.encode(FIXED)
        for step in range(steps):
            start = time.perf_counter()
            batch = rollouts_in_process(llm, prompts, step)
            mean_reward, rollout_gap = train_step(model, optimizer, batch)
            llm.sleep(level=1, tags=["kv_cache"])  # the weights stay for the update
            (ack,) = llm.update_weights(model.state_dict(), weight_version=step + 1)
            llm.wake_up(tags=["kv_cache"])
            probe = SamplingParams(max_tokens=1, prompt_logprobs=0)
            (out,) = llm.generate({"prompt_token_ids": fixed}, probe)
            served = [None] + [
                {t: e.logprob for t, e in entry.items()} for entry in out.prompt_logprobs[1:]
            ]
            report(
                step, start, len(batch), reward=mean_reward, rollout_gap=rollout_gap,
                sync_ms=ack["metadata"]["latency_ms"], gap=gap_to(served, model, fixed),
                same=llm.weights_checksum() == weights_checksum(model.state_dict().items()),
            )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running omnistage server (else one is started)")
    parser.add_argument(
        "--model", type=Path, help="its model folder (with --url; with --in-process: the model)"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--in-process", action="store_true", help="roll out with omnistage.LLM in this process"
    )
    args = parser.parse_args()
    if args.in_process and args.url:
        parser.error("--in-process runs no server: drop --url")
    if args.in_process and args.model is not None:
        run_in_process(args.model, args.steps)
        return
    if args.url:
        if args.model is None:
            parser.error("--url needs --model: the trainer loads the same checkpoint")
        run(args.url, args.model, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp) / "model")
        if args.in_process:
            run_in_process(model_dir, args.steps)
            return
        with tiny_server(model_dir) as url:
            run(url, model_dir, args.steps)


if __name__ == "__main__":
    main()
