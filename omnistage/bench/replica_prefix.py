"""Prefix-aware placement over AR replicas (``omnistage bench replicas``, its ``prefix``
table): an AR stage at 2 replicas (the ``bench`` pipeline's ~98 M-parameter model, each
replica at one torch thread, prefix caching on) serves ``groups`` groups of requests, each
group's prompts one shared head of ``head_tokens`` and a suffix of their own, sent
``concurrency`` at a time in a seeded shuffled order, greedy. Once with the placement the
server uses (a request goes where its head was served, unless that replica has more than
``prefix_slack`` requests more in flight than the least-loaded) and once least-loaded only,
each on a fresh server (nothing cached), ``repeats`` times taking turns. Per mode (means): the prompt tokens the replicas found
cached (their prefix caches' ``hit_tokens`` over ``queried_tokens``), the tokens they
prefilled, the requests per second and each request's tokens (equal in both modes)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from omnistage.bench.report import write_results

PREFIX_COLUMNS = ["pipeline", "replicas", "placement", "requests", "concurrency", "head_tokens",
                  "hit_rate", "prefilled_tokens", "requests_per_s", "same_tokens"]  # fmt: skip


async def _serve(
    omni: Any, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[list[list[int]], float, list[dict[str, Any]]]:
    """Each prompt's tokens, the seconds they all took, and the replicas' statuses after."""
    limit = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> list[int]:
        async with limit:
            tokens: list[int] = []
            params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
            async for out in omni.generate({"prompt_token_ids": ids}, params, ["text"]):
                tokens += out.new_token_ids
            return tokens

    started = time.perf_counter()
    tokens = list(await asyncio.gather(*(one(p) for p in prompts)))
    elapsed = time.perf_counter() - started
    return tokens, elapsed, (await omni.stage_status())[0]["replicas"]


def _prompts(groups: int, per_group: int, head: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    heads = [[rng.randrange(3, vocab) for _ in range(head)] for _ in range(groups)]
    prompts = [
        h + [rng.randrange(3, vocab) for _ in range(16)] for h in heads for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def measure(
    pipeline: str = "bench", *, groups: int = 4, per_group: int = 8, head_tokens: int = 768,
    concurrency: int = 4, max_tokens: int = 4, repeats: int = 2,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per placement (see the module docstring), its figures the mean of
    ``repeats`` runs, the two placements taking turns."""
    import json

    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server_config import with_replicas
    from omnistage.pipelines import load_pipeline

    config = with_replicas(
        load_pipeline(pipeline, torch_threads=1, enable_prefix_caching=True), ["0=2"]
    )
    folder = Path(config.stages[0].model)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    prompts = _prompts(groups, per_group, head_tokens, vocab)
    runs: dict[str, list[tuple[float, int, float]]] = {"prefix-aware": [], "least-loaded": []}
    answers: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for placement, runs_of in runs.items():
            omni = AsyncOmni.from_config(config)
            client: Any = omni.clients[0]
            if placement == "least-loaded":
                client.prefix_slack = -(10**9)  # a cached head never wins
            try:
                tokens, elapsed, statuses = asyncio.run(
                    _serve(omni, prompts, concurrency, max_tokens)
                )
            finally:
                omni.shutdown()
            queried = sum(s["prefix_cache"]["queried_tokens"] for s in statuses)
            hit = sum(s["prefix_cache"]["hit_tokens"] for s in statuses)
            runs_of.append(
                (hit / queried if queried else 0.0, queried - hit, len(prompts) / elapsed)
            )
            answers.setdefault(placement, tokens)
    rows = [
        {
            "pipeline": pipeline, "replicas": 2, "placement": placement,
            "requests": len(prompts), "concurrency": concurrency, "head_tokens": head_tokens,
            "hit_rate": sum(r[0] for r in measured) / len(measured),
            "prefilled_tokens": sum(r[1] for r in measured) / len(measured),
            "requests_per_s": sum(r[2] for r in measured) / len(measured),
        }
        for placement, measured in runs.items()
    ]  # fmt: skip
    for row in rows:
        row["same_tokens"] = answers["prefix-aware"] == answers["least-loaded"]
    return rows


def run(out_dir: str, device: str = "cpu", pipeline: str = "bench") -> str:
    """Write ``replicas-prefix-<device>.{json,md}``; return the table."""
    rows = measure(pipeline)
    return write_results(
        out_dir, f"replicas-prefix-{device.replace(':', '')}", rows, PREFIX_COLUMNS
    )
