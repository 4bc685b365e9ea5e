"""RL rollouts: generation throughput of GRPO-shaped batches with and without the prefix
cache, and weight-sync bandwidth per backend against an in-process copy of the same bytes.

- Rollouts: 8 prompts that share a 512-token system prefix, ``n = 8`` sampled answers each
  (32 tokens), on the ``demo`` model in this process; the baseline is the same engine with
  ``enable_prefix_caching`` off (the ``n`` samples of one prompt share its prefill either way).
  The seconds are split into prefill steps and decode steps (a step is one or the other).
- Weight sync: a real server serving the ``bench`` model (391 MB), a ``WeightSender`` pushing
  its whole state dict (gloo for ``nccl`` on CPU, the stage's shared staging for ``ipc``); the
  baseline is copying the same tensors into same-shaped ones in one process with torch's
  ``copy_`` (``copy_gbps``, what ``vs_copy`` divides by), measured in the same run, beside
  glibc's ``memmove`` of the same bytes (``memcpy_gbps``); ``apply_ms`` is the stage's copy
  into its live weights at ``finish``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from omnistage.bench.report import write_results
from omnistage.bench.robustness import Server
from omnistage.config import AROptions, StageConfig
from omnistage.pipelines import cache_dir
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.ar.wire import KIND

ROLLOUT_COLUMNS = [
    "prefix_caching",
    "samples",
    "generated_tokens",
    "prefill_tokens",
    "prefill_s",
    "decode_s",
    "seconds",
    "tokens_per_s",
    "speedup",
]
SYNC_COLUMNS = [
    "backend",
    "mib",
    "seconds",
    "apply_ms",
    "gbps",
    "copy_gbps",
    "memcpy_gbps",
    "vs_copy",
]
PREFIX, QUESTION, PROMPTS, SAMPLES, NEW_TOKENS = 512, 16, 8, 8, 32


def _rollout(caching: bool) -> dict[str, Any]:
    from omnistage.models.tiny import ensure_preset

    model = ensure_preset("demo", cache_dir() / "demo")
    config = StageConfig(
        stage_id=0, kind=KIND, model=str(model),
        ar=AROptions(max_model_len=1024, max_num_seqs=64, kv_cache_memory=256 << 20,
                     enable_prefix_caching=caching),
    )  # fmt: skip
    engine = ARStageEngine(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 500, (PREFIX,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 500, (QUESTION,), generator=generator).tolist()
               for _ in range(PROMPTS)]  # fmt: skip
    params = SamplingParams(n=SAMPLES, temperature=1.0, seed=1, max_tokens=NEW_TOKENS,
                            ignore_eos=True)  # fmt: skip
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(ARRequest(f"p{i}", prompt, params))
    generated, split = 0, [0.0, 0.0]  # seconds of prefill steps, of decode steps
    while engine.has_unfinished_requests():
        step_start, prefilled = time.perf_counter(), engine.num_prefill_tokens
        generated += sum(len(out.new_token_ids) for out in engine.step())
        split[engine.num_prefill_tokens == prefilled] += time.perf_counter() - step_start
    seconds = time.perf_counter() - start
    row = {
        "prefix_caching": caching,
        "samples": PROMPTS * SAMPLES,
        "generated_tokens": generated,
        "prefill_tokens": engine.num_prefill_tokens,
        "prefill_s": split[0],
        "decode_s": split[1],
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
    }
    engine.shutdown()
    return row


def bench_rollouts() -> list[dict[str, Any]]:
    _rollout(True)  # warm-up (imports, first allocations)
    rows = [_rollout(False), _rollout(True)]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def _copy_gbps(state: dict[str, torch.Tensor], nbytes: int, memmove: bool = False) -> float:
    """In-process copy bandwidth: torch's ``copy_``, or glibc's ``memmove`` (``memcopy``)."""
    from omnistage.rl.protocol import memcopy

    targets = {name: torch.empty_like(t) for name, t in state.items()}
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for name, tensor in state.items():
            if memmove:
                memcopy(targets[name].data_ptr(), tensor.data_ptr(), tensor.nbytes)
            else:
                targets[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def bench_sync(device: str = "cpu") -> list[dict[str, Any]]:
    from omnistage.models.loader import SafetensorsFile
    from omnistage.models.tiny import ensure_preset
    from omnistage.rl import WeightSender

    model = ensure_preset("bench", cache_dir() / "bench")
    with SafetensorsFile(model / "model.safetensors") as st:
        state = {name: st.tensor(name).clone() for name in st.keys()}  # noqa: SIM118
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copy_gbps, memcpy_gbps = _copy_gbps(state, nbytes), _copy_gbps(state, nbytes, memmove=True)
    rows = []
    with Server("--model", str(model), "--device", device, "--enable-sleep-mode") as server:
        for backend in ("nccl", "ipc"):
            with WeightSender(server.url, backend=backend) as sender:
                sender.init()
                sender.send(state.items(), weight_version=f"{backend}-warm")
                times, applies = [], []
                for i in range(3):
                    start = time.perf_counter()
                    ack = sender.send(state.items(), weight_version=f"{backend}-{i}")
                    times.append(time.perf_counter() - start)
                    applies.append(float(ack["metadata"]["latency_ms"]))
            seconds = statistics.median(times)
            rows.append({
                "backend": f"{backend} ({'gloo' if backend == 'nccl' and device == 'cpu' else backend})",
                "mib": nbytes / 2**20, "seconds": seconds, "apply_ms": statistics.median(applies),
                "gbps": nbytes / seconds / 1e9, "copy_gbps": copy_gbps, "memcpy_gbps": memcpy_gbps,
                "vs_copy": nbytes / seconds / 1e9 / copy_gbps,
            })  # fmt: skip
    return rows


def run(out_dir: str, device: str = "cpu") -> str:
    name = device.replace(":", "")
    return "\n\n".join(
        [
            write_results(out_dir, f"rollouts-{name}", bench_rollouts(), ROLLOUT_COLUMNS),
            write_results(out_dir, f"weight-sync-{name}", bench_sync(device), SYNC_COLUMNS),
        ]
    )
