"""Qwen2.5-Omni speech under load, on the tiny and the bench-size preset: the goals of
streamed speech (time to first audio against the whole audio, throughput at 8 concurrent
requests against one at a time and against transformers' ``generate``, every request's audio
the same at any concurrency) measured in one run, with where each stage's time goes.

For each pipeline, ``omnistage serve --pipeline P`` is started once per variant (its flags
and code2wav settings: ``VARIANTS``; streamed as shipped, streamed with the code2wav stage
stepping on one thread, and ``--no-stream`` for the whole-audio baseline) and loaded by
``bench serve`` (streamed chat requests, text + pcm16 audio, the same random prompts and
seed in every run): ``REQUESTS[c]`` requests ``c`` at a time, after one warm-up. Per run the
stage processes' CPU seconds (``psutil``, by the pids ``/v1/omni/stages`` reports) say
where the time goes, and the code2wav stage's step counters how many of its synthesis steps
several utterances shared. The baseline is transformers' ``generate`` one request after
another on the same checkpoint with replies as long (``omni.TransformersRunner``), in this
process after the servers have stopped.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from omnistage.bench.omni_stream import REQUESTS, load_columns, speech_load
from omnistage.bench.report import write_results
from omnistage.bench.serve import ServeBenchConfig, bench
from omnistage.bench.served import Served

PIPELINES = ("tiny-qwen2.5-omni", "bench-qwen2.5-omni")
STAGES = ("thinker", "talker", "code2wav")
# variant -> (omnistage serve flags, settings of the code2wav stage over the pipeline's);
# "whole" (--no-stream) is the time-to-whole-audio baseline
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, int]]] = {
    "streamed": ((), {}),
    "streamed-1-step-thread": ((), {"step_threads": 1}),  # the stage's groups one at a time
    "streamed-c2w-2-threads": ((), {"torch_threads": 2}),  # measured once: 10x slower
    "whole": (("--no-stream",), {}),
}
COLUMNS = ["pipeline", "variant", "concurrency", "requests", "ttfa_ms", "e2e_ms",
           "requests_per_s", "vs_concurrency_1", "vs_transformers", "ttfa_vs_whole",
           "audio_as_alone", "thinker_cpu_s", "talker_cpu_s", "code2wav_cpu_s",
           "cpu_busy", "batched_steps"]  # fmt: skip


@dataclass(frozen=True)
class LoadSettings:
    pipelines: tuple[str, ...] = PIPELINES
    variants: tuple[str, ...] = ("streamed", "streamed-1-step-thread", "whole")
    transformers_prompts: int = 2
    thinker_tokens: int = 16
    talker_tokens: int = 256  # the pipelines' cap (the random talker never says its end code)
    num_steps: int = 10
    whole_concurrency: tuple[int, ...] = (1,)  # the whole baseline's concurrencies


def serve_config(url: str, concurrency: int, s: LoadSettings) -> ServeBenchConfig:
    return speech_load(url, concurrency, s.thinker_tokens, s.talker_tokens, s.num_steps)


class StageMeter:
    """CPU seconds of each stage process and the code2wav stage's step counters."""

    def __init__(self, url: str) -> None:
        import psutil

        self.url = url
        stages = self._stages()
        self.processes = {s["name"]: psutil.Process(s["pid"]) for s in stages}

    def _stages(self) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/v1/omni/stages", timeout=30)
        response.raise_for_status()
        return list(response.json()["stages"])

    def read(self) -> dict[str, float]:
        out = {}
        for name, process in self.processes.items():
            times = process.cpu_times()
            out[name] = times.user + times.system
        stages = self._stages()  # only the code2wav stage counts synthesis steps
        out["steps"] = sum(s.get("num_synthesis_steps", 0) for s in stages)
        out["batched"] = sum(s.get("num_batched_steps", 0) for s in stages)
        return out


def measure_one(url: str, concurrency: int, s: LoadSettings) -> dict[str, Any]:
    meter = StageMeter(url)
    before = meter.read()
    summary, results = asyncio.run(bench(serve_config(url, concurrency, s)))
    after = meter.read()
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"x{concurrency}: {len(failed)} requests failed: {failed[0]}")
    ttfa = [r.ttfa for r in results if r.ttfa is not None]
    n = len(results) + 1  # the warm-up request ran inside the meter too
    cpu = {name: (after[name] - before[name]) / n for name in STAGES}
    steps = after["steps"] - before["steps"]
    return {
        "summary": summary,
        "audio": [b"".join(r.audio) for r in results],
        "ttfa_ms": statistics.mean(ttfa) * 1e3 if ttfa else None,
        "e2e_ms": statistics.mean(r.latency for r in results) * 1e3,
        "cpu": cpu,
        # synthesis steps several utterances shared (a shared step counts once)
        "batched_steps": f"{after['batched'] - before['batched']}/{steps}",
    }


def pipeline_args(pipeline: str, code2wav: dict[str, int], folder: Path) -> list[str]:
    """``--pipeline P``, or ``--config`` of P's YAML with the code2wav stage's ``code2wav``
    settings."""
    if not code2wav:
        return ["--pipeline", pipeline]
    from importlib import resources

    import yaml

    from omnistage.pipelines import cache_dir

    text = (resources.files("omnistage.pipelines") / f"{pipeline}.yaml").read_text()
    config = yaml.safe_load(text.replace("{cache}", str(cache_dir())))  # a file's is literal
    config["stages"][-1].update(code2wav)  # the last stage speaks
    name = "-".join(f"{k}-{v}" for k, v in sorted(code2wav.items()))
    path = folder / f"{pipeline}-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return ["--config", str(path)]


def measure(pipeline: str, s: LoadSettings, device: str) -> dict[tuple[str, int], Any]:
    import tempfile

    runs: dict[tuple[str, int], Any] = {}
    for variant in s.variants:
        concurrencies = s.whole_concurrency if variant == "whole" else tuple(REQUESTS)
        flags, code2wav = VARIANTS[variant]
        with (
            tempfile.TemporaryDirectory() as tmp,
            Served(
                *pipeline_args(pipeline, code2wav, Path(tmp)), "--device", device, *flags
            ) as server,
        ):
            for concurrency in concurrencies:
                runs[variant, concurrency] = measure_one(server.url, concurrency, s)
    return runs


def transformers_rate(pipeline: str, s: LoadSettings, device: str) -> float:
    """Requests/s of transformers' ``generate`` one after another."""
    from omnistage.bench import omni
    from omnistage.pipelines import load_pipeline

    folder = Path(load_pipeline(pipeline, device=device).stages[0].model)
    settings = replace(
        omni.Settings(), prompts=omni.PROMPTS[: s.transformers_prompts], thinker_tokens=s.thinker_tokens,
        talker_tokens=s.talker_tokens, num_steps=s.num_steps,
    )  # fmt: skip
    timed = omni.TransformersRunner(folder, settings, device).run()
    return len(settings.prompts) / timed.seconds


def rows(pipeline: str, runs: dict[tuple[str, int], Any], baseline: float) -> list[dict]:
    out = []
    for (variant, concurrency), run in runs.items():
        alone = runs[variant, 1]  # every variant runs at concurrency 1
        # the audio to match: the variant's own at concurrency 1 (whole), else the first
        # streamed variant's (any thread count must give the same bytes)
        streamed = [v for v, c in runs if c == 1 and v != "whole"]
        reference = alone if variant == "whole" else runs[streamed[0], 1]
        same = sum(a == b for a, b in zip(run["audio"], reference["audio"], strict=False))
        whole = runs.get(("whole", concurrency))
        busy = sum(run["cpu"].values()) * len(run["audio"])
        duration = float(run["summary"]["duration"])
        out.append(
            {
                "pipeline": pipeline,
                "variant": variant,
                "concurrency": concurrency,
                **load_columns(run, alone, baseline),
                "ttfa_vs_whole": run["ttfa_ms"] / whole["e2e_ms"]
                if whole and run["ttfa_ms"]
                else None,
                "audio_as_alone": f"{same}/{min(len(run['audio']), len(reference['audio']))}",
                **{f"{name}_cpu_s": run["cpu"][name] for name in STAGES},
                "cpu_busy": busy / duration,
                "batched_steps": run["batched_steps"],
            }
        )
    return out


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: Sequence[str] = PIPELINES,
    settings: LoadSettings | None = None,
) -> str:
    """Write ``omni-load-<device>.{json,md}`` and return the table."""
    s = replace(settings or LoadSettings(), pipelines=tuple(pipelines))
    table: list[dict] = []
    for pipeline in s.pipelines:
        runs = measure(pipeline, s, device)
        table += rows(pipeline, runs, transformers_rate(pipeline, s, device))
    return write_results(out_dir, f"omni-load-{device.replace(':', '')}", table, COLUMNS)
