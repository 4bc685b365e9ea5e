"""Stage replicas (``replicas: N``) against one process, through a real ``omnistage serve``:
what a second process of the heaviest stage buys in throughput on the cores there are, and
what it costs a sleep and wake.

Per pipeline, its step-scheduled stage (a Qwen2.5-Omni pipeline's code2wav stage, a diffusion
pipeline's diffusion stage) at 1 and at 2 replicas, every stage process at ``torch_threads:
1`` and the replicated stage stepping ``cores // replicas`` groups of jobs at once, prefix
caching off, sleep mode on. The same ``requests`` one at a time (each output alone, and
``cpu_s_alone``: the CPU seconds of every stage process per request), then all at once
(speech: 8, images: 4): ``core_bound_per_s`` is ``os.cpu_count()`` over ``cpu_s_alone`` and
``vs_core_bound`` the measured rate over it; ``replica_cpu_s``, ``cpu_busy`` and
``others_busy`` say where the CPU went; ``audio_as_alone``, ``images_as_alone`` and
``same_as_1_replica`` check the outputs bit for bit. Then ``cycles`` sleep (level 1) + wake
round trips of the replicated stage over HTTP; medians, and 2 replicas over 1. The columns and
the reading: docs/benchmarks.md, *Stage replicas*.
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from omnistage.bench import replica_prefix
from omnistage.bench.control_http import _percentile, _post_ms
from omnistage.bench.omni_stream import speech_load
from omnistage.bench.report import write_results
from omnistage.bench.serve import bench
from omnistage.bench.served import Served
from omnistage.stage.kinds import stage_kind

PIPELINES = ("tiny-qwen2.5-omni", "bench-qwen2.5-omni", "tiny-flux")
REPLICATED_KINDS = ("code2wav", "diffusion")  # the stage replicated: the last of these kinds
IMAGE_PROMPTS = ("a red cat", "a tan dog", "a big owl", "a wet fox", "a tall elk", "a cold sea")
THROUGHPUT_COLUMNS = ["pipeline", "stage", "replicas", "step_threads", "torch_threads",
                      "concurrency", "requests", "ttfa_ms", "e2e_ms", "requests_per_s",
                      "cpu_s_alone", "cpu_s_per_request", "core_bound_per_s", "vs_core_bound",
                      "vs_1_replica", "replica_cpu_s", "cpu_busy", "others_busy",
                      "api_cpu_s", "audio_as_alone", "same_as_1_replica"]  # fmt: skip
IMAGE_COLUMNS = ["pipeline", "stage", "replicas", "step_threads", "torch_threads",
                 "concurrency", "requests", "e2e_ms", "images_per_s", "cpu_s_alone",
                 "cpu_s_per_request", "core_bound_per_s", "vs_core_bound", "vs_1_replica",
                 "replica_cpu_s", "cpu_busy", "others_busy", "api_cpu_s", "images_as_alone",
                 "same_as_1_replica"]  # fmt: skip
SLEEP_COLUMNS = ["pipeline", "stage", "replicas", "level", "cycles", "sleep_p50_ms",
                 "wake_p50_ms", "round_trip_p50_ms", "round_trip_p90_ms",
                 "round_trip_vs_1_replica"]  # fmt: skip

# A connection per call, as the bench was measured: kept-alive replies used to wait ~40 ms
# for a delayed ACK (the listening socket made without IPPROTO_TCP; fixed since).
FRESH = httpx.Limits(max_keepalive_connections=0)

BUSY = ("user", "nice", "system", "irq", "softirq", "steal")  # a machine's busy time (Linux)


@dataclass(frozen=True)
class ReplicaSettings:
    pipelines: tuple[str, ...] = PIPELINES
    replicas: tuple[int, ...] = (1, 2)  # the first is the baseline of the vs_1_replica columns
    torch_threads: int = 1  # every stage process's
    speech_requests: int = 8  # one at a time, then all at once
    image_requests: int = 4
    thinker_tokens: int = 16
    talker_tokens: int = 128  # ~0.5 s of speech tiny, ~2.6 s bench size
    num_steps: int = 10
    image_size: str = "128x128"
    image_steps: int = 10
    cycles: int = 10  # sleep/wake cycles per server
    level: int = 1


def is_speech(config: dict[str, Any]) -> bool:
    return any(stage_kind(stage["kind"]).modality == "audio" for stage in config["stages"])


def replicated_stage(config: dict[str, Any]) -> dict[str, Any]:
    """The stage a run replicates: the pipeline's last step-scheduled one."""
    stages = [s for s in config["stages"] if s["kind"] in REPLICATED_KINDS]
    if not stages:
        kinds = [s["kind"] for s in config["stages"]]
        raise ValueError(f"no stage of kind {' or '.join(REPLICATED_KINDS)} to replicate: {kinds}")
    return stages[-1]


def pipeline_file(
    pipeline: str, replicas: int, s: ReplicaSettings, folder: Path, cores: int
) -> tuple[Path, dict[str, Any], bool]:
    """The built-in pipeline's file with every stage at ``torch_threads`` and its replicated
    stage at ``replicas``, stepping ``cores // (replicas x torch_threads)`` groups at once
    (at least one); the path, that stage's mapping, and whether the pipeline speaks."""
    from importlib import resources

    import yaml

    from omnistage.pipelines import cache_dir

    text = (resources.files("omnistage.pipelines") / f"{pipeline}.yaml").read_text()
    config = yaml.safe_load(text.replace("{cache}", str(cache_dir())))
    for stage in config["stages"]:
        stage["torch_threads"] = s.torch_threads
    stage = replicated_stage(config)
    stage["replicas"] = replicas
    stage["step_threads"] = max(1, cores // (replicas * s.torch_threads))
    path = folder / f"{pipeline}-replicas-{replicas}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, stage, is_speech(config)


class CpuMeter:
    """CPU seconds of every stage process by name (``code2wav.1`` a replica's, ``.rankN`` a
    rank's), of the API process (``api``), and of everything else on the machine
    (``others``: all cores' busy time less this process's and the server's), by the pids
    ``/v1/omni/stages`` reports."""

    def __init__(self, server: Served) -> None:
        import psutil

        stages = httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"]
        self.processes: dict[str, Any] = {}
        for stage in stages:
            replicas = stage.get("replicas")
            for process in replicas or [stage]:
                name = f"{stage['name']}.{process['replica_id']}" if replicas else stage["name"]
                pids = dict.fromkeys([process["pid"], *(process.get("rank_pids") or [])])
                for rank, pid in enumerate(pids):
                    self.processes[name if not rank else f"{name}.rank{rank}"] = psutil.Process(pid)
        self.api = psutil.Process(server.process.pid)
        self.client = psutil.Process()
        self._machine = psutil.cpu_times

    @staticmethod
    def _seconds(process: Any) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    def read(self) -> dict[str, float]:
        out = {name: self._seconds(p) for name, p in self.processes.items()}
        out["api"] = self._seconds(self.api)
        machine = self._machine()
        busy = sum(getattr(machine, f, 0.0) for f in BUSY)
        out["others"] = busy - sum(out.values()) - self._seconds(self.client)
        return out


def metered(meter: CpuMeter, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``'s run with its CPU seconds per request (all stages, each process, the
    API), the cores the stages kept busy and those everything else kept busy."""
    before = meter.read()
    run = measure()
    after = meter.read()
    n, duration = len(run["outputs"]), run["duration"]
    spent = {name: after[name] - before[name] for name in before}
    stages = sum(v for name, v in spent.items() if name not in ("api", "others"))
    return {
        **run,
        "cpu_s": stages / n,
        "api_cpu_s": spent["api"] / n,
        "cpu_s_by_process": {name: spent[name] / n for name in meter.processes},
        "cpu_busy": stages / duration,
        "others_busy": round(max(0.0, spent["others"]) / duration, 3),  # clock-tick noise
    }


def speech_run(url: str, concurrency: int, requests: int, s: ReplicaSettings) -> dict[str, Any]:
    """``requests`` seeded speech requests (``bench serve``'s random prompts, the same in
    every run), ``concurrency`` at a time."""
    config = replace(
        speech_load(url, 1, s.thinker_tokens, s.talker_tokens, s.num_steps),
        num_prompts=requests, max_concurrency=concurrency, num_warmups=0,
    )  # fmt: skip
    summary, results = asyncio.run(bench(config))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"x{concurrency}: {len(failed)} requests failed: {failed[0]}")
    ttfa = [r.ttfa for r in results if r.ttfa is not None]
    return {
        "outputs": [b"".join(r.audio) for r in results],
        "ttfa_ms": statistics.mean(ttfa) * 1e3 if ttfa else None,
        "e2e_ms": statistics.mean(r.latency for r in results) * 1e3,
        "duration": float(summary["duration"]),
    }


def image_run(url: str, concurrency: int, requests: int, s: ReplicaSettings) -> dict[str, Any]:
    """``requests`` images (``IMAGE_PROMPTS``, seeds 0, 1, ...), ``concurrency`` at a time."""

    async def go() -> dict[str, Any]:
        slots = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=FRESH) as client:

            async def one(index: int) -> tuple[bytes, float]:
                body = {
                    "prompt": IMAGE_PROMPTS[index % len(IMAGE_PROMPTS)],
                    "seed": index,
                    "size": s.image_size,
                    "num_inference_steps": s.image_steps,
                }
                async with slots:
                    sent = time.perf_counter()
                    reply = await client.post("/v1/images/generations", json=body)
                    if reply.status_code != 200:
                        raise RuntimeError(f"image {index}: {reply.status_code} {reply.text}")
                    png = base64.b64decode(reply.json()["data"][0]["b64_json"])
                    return png, time.perf_counter() - sent

            start = time.perf_counter()
            done = await asyncio.gather(*(one(i) for i in range(requests)))
            duration = time.perf_counter() - start
        return {
            "outputs": [png for png, _ in done],
            "ttfa_ms": None,
            "e2e_ms": statistics.mean(t for _, t in done) * 1e3,
            "duration": duration,
        }

    return asyncio.run(go())


def sleep_wake(url: str, stage_id: int, cycles: int, level: int) -> dict[str, Any]:
    """``cycles`` sleep → wake round trips of ``stage_id`` (every replica), after one."""
    sleeps, wakes = [], []
    with httpx.Client(base_url=url, timeout=120, limits=FRESH) as client:
        for cycle in range(cycles + 1):
            sleep_ms = _post_ms(client, "/v1/omni/sleep", {"stage_ids": [stage_id], "level": level})
            wake_ms = _post_ms(client, "/v1/omni/wakeup", {"stage_ids": [stage_id]})
            if cycle:  # the first is the warm-up
                sleeps.append(sleep_ms)
                wakes.append(wake_ms)
    return {"sleep": sleeps, "wake": wakes}


def measure(
    pipeline: str, replicas: int, s: ReplicaSettings, device: str, cores: int
) -> dict[str, Any]:
    """One server of ``pipeline`` at ``replicas``: its runs alone and at once, and its sleep
    and wake cycles."""
    with tempfile.TemporaryDirectory() as tmp:
        path, stage, speech = pipeline_file(pipeline, replicas, s, Path(tmp), cores)
        run_one, requests = (
            (speech_run, s.speech_requests) if speech else (image_run, s.image_requests)
        )
        print(f"[bench] {pipeline}: {stage['name']} at {replicas} replicas, "
              f"{stage['step_threads']} step threads", flush=True)  # fmt: skip
        with Served(
            "--config", str(path), "--device", device, "--enable-sleep-mode",
            "--no-enable-prefix-caching", "--disable-log-requests",
        ) as server:  # fmt: skip
            run_one(server.url, 1, replicas, s)  # a warm-up on each replica (ties take turns)
            meter = CpuMeter(server)
            alone = metered(meter, lambda: run_one(server.url, 1, requests, s))
            together = metered(meter, lambda: run_one(server.url, requests, requests, s))
            cycles = sleep_wake(server.url, stage["stage_id"], s.cycles, s.level)
    return {
        "stage": f"{stage['stage_id']} ({stage['name']})",
        "name": stage["name"],
        "speech": speech,
        "step_threads": stage["step_threads"],
        "runs": {1: alone, requests: together},
        "sleep_wake": cycles,
    }


def throughput_rows(
    pipeline: str, measured: dict[int, dict[str, Any]], cores: int, torch_threads: int
) -> list[dict[str, Any]]:
    """Per replica count and concurrency: the rate against the core bound (from the run alone)
    and against the first replica count's, and the outputs against alone."""
    first = measured[min(measured)]
    columns = THROUGHPUT_COLUMNS if first["speech"] else IMAGE_COLUMNS
    out = []
    for replicas, session in measured.items():
        alone = session["runs"][1]
        reference = first["runs"][1]["outputs"]
        bound = cores / alone["cpu_s"]
        for concurrency, run in session["runs"].items():
            rate = len(run["outputs"]) / run["duration"]  # every request answered
            base = first["runs"][concurrency]
            same = sum(a == b for a, b in zip(run["outputs"], alone["outputs"], strict=True))
            as_first = sum(a == b for a, b in zip(run["outputs"], reference, strict=True))
            n = len(run["outputs"])
            as_alone = "-" if concurrency == 1 else f"{same}/{n}"  # alone is its own reference
            row = {
                "pipeline": pipeline,
                "stage": session["stage"],
                "replicas": replicas,
                "step_threads": session["step_threads"],
                "torch_threads": torch_threads,
                "concurrency": concurrency,
                "requests": n,
                "ttfa_ms": run["ttfa_ms"],
                "e2e_ms": run["e2e_ms"],
                "requests_per_s": rate,
                "images_per_s": rate,
                "cpu_s_alone": alone["cpu_s"],
                "cpu_s_per_request": run["cpu_s"],
                "core_bound_per_s": bound,
                "vs_core_bound": rate / bound,
                "vs_1_replica": rate / (len(base["outputs"]) / base["duration"]),
                "replica_cpu_s": "/".join(
                    f"{v:.3g}"
                    for k, v in run["cpu_s_by_process"].items()
                    if k == session["name"] or k.startswith(session["name"] + ".")
                ),
                "cpu_busy": run["cpu_busy"],
                "others_busy": run["others_busy"],
                "api_cpu_s": run["api_cpu_s"],
                "audio_as_alone": as_alone,
                "images_as_alone": as_alone,
                "same_as_1_replica": "-" if run is first["runs"][1] else f"{as_first}/{n}",
            }
            extra = {"cpu_s_by_process": run["cpu_s_by_process"]}  # in the JSON only
            out.append({**{c: row[c] for c in columns}, **extra})
    return out


def sleep_rows(
    pipeline: str, measured: dict[int, dict[str, Any]], level: int
) -> list[dict[str, Any]]:
    out = []
    for replicas, session in measured.items():
        cycles = session["sleep_wake"]
        trips = [a + b for a, b in zip(cycles["sleep"], cycles["wake"], strict=True)]
        out.append(
            {
                "pipeline": pipeline,
                "stage": session["stage"],
                "replicas": replicas,
                "level": level,
                "cycles": len(trips),
                "sleep_p50_ms": statistics.median(cycles["sleep"]),
                "wake_p50_ms": statistics.median(cycles["wake"]),
                "round_trip_p50_ms": statistics.median(trips),
                "round_trip_p90_ms": _percentile(trips, 0.9),
            }
        )
    for row in out:
        row["round_trip_vs_1_replica"] = row["round_trip_p50_ms"] / out[0]["round_trip_p50_ms"]
    return out


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: Sequence[str] = PIPELINES,
    repeats: int | None = None,
    settings: ReplicaSettings | None = None,
) -> str:
    """Write ``replicas-{speech,images,sleep}-<device>.{json,md}``; return the tables.
    ``repeats``: sleep/wake cycles per server (default 10)."""
    s = replace(settings or ReplicaSettings(), pipelines=tuple(pipelines))
    if repeats is not None:
        s = replace(s, cycles=repeats)
    cores = os.cpu_count() or 1
    speech: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    sleeps: list[dict[str, Any]] = []
    for pipeline in s.pipelines:
        measured = {n: measure(pipeline, n, s, device, cores) for n in s.replicas}
        rows = throughput_rows(pipeline, measured, cores, s.torch_threads)
        (speech if measured[s.replicas[0]]["speech"] else images).extend(rows)
        sleeps += sleep_rows(pipeline, measured, s.level)
    name = device.replace(":", "")
    tables = []
    if speech:
        tables.append(write_results(out_dir, f"replicas-speech-{name}", speech, THROUGHPUT_COLUMNS))
    if images:
        tables.append(write_results(out_dir, f"replicas-images-{name}", images, IMAGE_COLUMNS))
    tables.append(write_results(out_dir, f"replicas-sleep-{name}", sleeps, SLEEP_COLUMNS))
    tables.append(replica_prefix.run(out_dir, device))
    return "\n\n".join(tables)
