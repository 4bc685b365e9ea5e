"""AR stage: ``LLM.generate`` throughput against batched ``transformers.generate`` on the same
checkpoint in the same run, and sleep/wake latency and freed memory per level.

Presets are built (once) into the model cache folder. Both engines decode 32 prompts of mixed
lengths greedily for a fixed number of tokens (eos ignored), so they do the same work.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from omnistage.bench.report import write_results
from omnistage.entrypoints.llm import LLM
from omnistage.memory import process_resident_bytes
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from omnistage.stage.ar.sampling_params import SamplingParams

MiB = 1 << 20
NUM_PROMPTS = 32
NEW_TOKENS = 64
MAX_MODEL_LEN = 128
THROUGHPUT_COLUMNS = [
    "preset",
    "params_m",
    "prompts",
    "new_tokens",
    "omnistage_tok_s",
    "transformers_tok_s",
    "speedup",
    "identical_outputs",
]
SLEEP_COLUMNS = [
    "preset",
    "level",
    "sleep_ms",
    "wake_ms",
    "freed_mib",
    "rss_drop_mib",
    "weights_mib",
    "kv_cache_mib",
    "outputs_identical",
]


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 40))]
        for _ in range(NUM_PROMPTS)
    ]


def _omnistage_generate(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def _transformers_generate(path: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        model.generate(
            input_ids[:2, -8:], attention_mask=mask[:2, -8:], **{**kwargs, "max_new_tokens": 4}
        )
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def bench_throughput(preset: str, path: Path, llm: LLM) -> dict[str, Any]:
    prompts = _prompts(llm.engine.model_config.vocab_size)
    _omnistage_generate(llm, prompts[:2])  # warm-up
    ours_s, ours = _omnistage_generate(llm, prompts)
    theirs_s, theirs = _transformers_generate(path, prompts)
    num_tokens = NUM_PROMPTS * NEW_TOKENS
    params = sum(p.numel() for p in llm.engine.worker.runner.model.parameters())
    return {
        "preset": preset,
        "params_m": params / 1e6,
        "prompts": NUM_PROMPTS,
        "new_tokens": NEW_TOKENS,
        "omnistage_tok_s": num_tokens / ours_s,
        "transformers_tok_s": num_tokens / theirs_s,
        "speedup": theirs_s / ours_s,
        "identical_outputs": f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{NUM_PROMPTS}",
    }


def bench_sleep(preset: str, llm: LLM, repeats: int = 3) -> list[dict[str, Any]]:
    prompts = _prompts(llm.engine.model_config.vocab_size)[:4]
    _, expected = _omnistage_generate(llm, prompts)
    tags = llm.memory_stats()["tags"]
    rows = []
    for level in (1, 2):
        sleep_ms, wake_ms, freed, rss_drop = [], [], [], []
        identical = True
        for _ in range(repeats):
            before = process_resident_bytes()
            ack, *_ = llm.sleep(level=level)
            rss_drop.append(before - process_resident_bytes())
            wake, *_ = llm.wake_up()
            sleep_ms.append(ack["metadata"]["latency_ms"])
            wake_ms.append(wake["metadata"]["latency_ms"])
            freed.append(ack["freed_bytes"])
            identical &= _omnistage_generate(llm, prompts)[1] == expected
        rows.append(
            {
                "preset": preset,
                "level": level,
                "sleep_ms": statistics.median(sleep_ms),
                "wake_ms": statistics.median(wake_ms),
                "freed_mib": statistics.median(freed) / MiB,
                "rss_drop_mib": statistics.median(rss_drop) / MiB,
                "weights_mib": tags["weights"]["reserved_bytes"] / MiB,
                "kv_cache_mib": tags["kv_cache"]["reserved_bytes"] / MiB,
                "outputs_identical": identical,
            }
        )
    return rows


def run(out_dir: str, device: str = "cpu", presets: tuple[str, ...] = ("demo", "bench")) -> str:
    throughput: list[dict[str, Any]] = []
    sleep_rows: list[dict[str, Any]] = []
    for preset in presets:
        path = ensure_preset(preset, cache_dir() / preset)
        with LLM(
            str(path),
            device=device,
            max_num_seqs=NUM_PROMPTS,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory=NUM_PROMPTS * MAX_MODEL_LEN * _kv_bytes_per_token(path) + 4 * MiB,
            enable_sleep_mode=True,  # it measures sleep and wake too
        ) as llm:
            throughput.append(bench_throughput(preset, path, llm))
            if preset == "bench":
                sleep_rows += bench_sleep(preset, llm)
    name = f"ar-{device.replace(':', '')}"
    tables = [write_results(out_dir, name + "-throughput", throughput, THROUGHPUT_COLUMNS)]
    if sleep_rows:
        tables.append(write_results(out_dir, name + "-sleep", sleep_rows, SLEEP_COLUMNS))
    return "\n\n".join(tables)


def _kv_bytes_per_token(path: Path) -> int:
    from omnistage.models.ar_config import ARModelConfig

    config = ARModelConfig.from_pretrained(path)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
