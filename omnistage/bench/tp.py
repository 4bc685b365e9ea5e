"""Tensor parallelism: decode throughput of one AR model split over 2 ranks against 1 rank,
in the same run (``LLM``, in this process; rank 1 in a process of its own).

For each batch size, ``seqs`` prompts of 16 tokens decode ``new_tokens`` tokens greedily
(eos ignored); ``tokens_per_s`` is generated tokens over the wall time of the whole batch,
median of ``repeats``. The cores are shared fairly: TP = 1 computes on ``cores`` threads,
each TP = 2 rank on ``cores / 2``. ``same_ids``: the share of sequences whose tokens equal
TP = 1's (a rank sums its partial results in another order than one rank does, so a
near-tie may go the other way on a random model).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from omnistage.bench.report import write_results
from omnistage.pipelines import load_pipeline

COLUMNS = [
    "pipeline",
    "tp",
    "threads_per_rank",
    "seqs",
    "new_tokens",
    "tokens_per_s",
    "vs_tp1",
    "same_ids",
]


def _decode(llm: Any, seqs: int, new_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    from omnistage.stage.ar.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 400, (16,), generator=gen).tolist()}
        for _ in range(seqs)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    times, ids = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
        ids = [o.outputs[0].token_ids for o in outputs]
    return seqs * new_tokens / statistics.median(times), ids


def run(
    out_dir: str,
    device: str = "cpu",
    pipeline: str = "bench",
    batch_sizes: tuple[int, ...] = (1, 8),
    new_tokens: int = 32,
    repeats: int = 3,
) -> str:
    from omnistage.entrypoints.llm import LLM

    model = load_pipeline(pipeline, device=device).stages[0].model
    cores = max(2, os.cpu_count() or 2)
    rows: list[dict[str, Any]] = []
    baseline: dict[int, tuple[float, list[list[int]]]] = {}
    name = f"tp-{device.replace(':', '')}"
    for tp in (1, 2):
        threads = cores // tp
        torch.set_num_threads(threads)
        llm = LLM(
            model, device=device, tensor_parallel_size=tp, torch_threads=threads,
            kv_cache_memory=64 * 2**20,
        )  # fmt: skip
        try:
            for seqs in batch_sizes:
                tokens_per_s, ids = _decode(llm, seqs, new_tokens, repeats)
                if tp == 1:
                    baseline[seqs] = (tokens_per_s, ids)
                base_rate, base_ids = baseline[seqs]
                same = sum(a == b for a, b in zip(ids, base_ids, strict=True)) / len(ids)
                rows.append(
                    {
                        "pipeline": pipeline,
                        "tp": tp,
                        "threads_per_rank": threads,
                        "seqs": seqs,
                        "new_tokens": new_tokens,
                        "tokens_per_s": tokens_per_s,
                        "vs_tp1": tokens_per_s / base_rate,
                        "same_ids": same,
                    }
                )
                write_results(out_dir, name, rows, COLUMNS)
        finally:
            llm.shutdown()
    torch.set_num_threads(cores)
    return write_results(out_dir, name, rows, COLUMNS)
