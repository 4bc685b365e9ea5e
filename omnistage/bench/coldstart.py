"""Cold start: what a stage process imports and builds before it serves, and how long a
pipeline takes from spawn to its first token and ``omnistage serve`` to ready.

Per stage of each pipeline, a fresh interpreter (``python -X importtime``) does what a stage
process does before its ``Ready``: imports the spawn target (``omnistage.stage.proc``), then its
kind's engine module, then builds the engine (weights loaded). Rows:

- ``import_ms``: both imports; ``torch_ms``, ``omnistage_ms`` and ``other_ms`` split them by
  top-level package (self times from ``-X importtime``); ``heavy`` lists the packages among
  ``HEAVY`` that were imported (an AR stage should import none);
- ``build_ms``: the engine build (kind-specific imports made there are counted here too);
- ``first_token_ms`` (the pipeline's): ``AsyncOmni.from_pipeline`` to the first streamed
  token of a 1-token request — spawn, imports, build, handshake — median of ``repeats``;
- ``serve_ready_ms``, ``serve_first_token_ms`` (the pipeline's): ``omnistage serve`` started
  as a command to ``/health`` answering 200 and to a 1-token chat completion's answer.

The JSON keeps each stage's ten most expensive packages (``top_packages``).
"""

from __future__ import annotations

import compileall
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

import omnistage
from omnistage.bench.control import cold_start_ms
from omnistage.bench.report import write_results
from omnistage.pipelines import load_pipeline

COLUMNS = [
    "pipeline",
    "stage",
    "kind",
    "import_ms",
    "torch_ms",
    "omnistage_ms",
    "other_ms",
    "heavy",
    "build_ms",
    "first_token_ms",
    "serve_ready_ms",
    "serve_first_token_ms",
]
HEAVY = ("transformers", "diffusers", "fastapi", "uvicorn", "httpx", "jinja2", "PIL", "sympy")
_LINE = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|( *)(\S+)")

# What a stage process does before ``Ready``, timed phase by phase (stdout: JSON).
_STAGE_SCRIPT = """
import importlib, json, sys, time
t0 = time.perf_counter()
import omnistage.stage.proc as proc
from omnistage.stage.kinds import stage_kind
from omnistage.pipelines import load_pipeline
stage = load_pipeline(sys.argv[1], device=sys.argv[3]).stages[int(sys.argv[2])]
t1 = time.perf_counter()
importlib.import_module(stage_kind(stage.kind).engine.partition(":")[0])
t2 = time.perf_counter()
engine = proc.build_engine(stage)
t3 = time.perf_counter()
engine.shutdown()
print(json.dumps({"kind": stage.kind, "import_s": t2 - t0, "build_s": t3 - t2}))
"""


def import_breakdown(stderr: str) -> Counter[str]:
    """Self import time (µs) per top-level package, from ``-X importtime`` output."""
    totals: Counter[str] = Counter()
    for line in stderr.splitlines():
        match = _LINE.match(line)
        if match:
            totals[match.group(3).split(".")[0]] += int(match.group(1))
    return totals


def stage_row(pipeline: str, stage_id: int, device: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _STAGE_SCRIPT, pipeline, str(stage_id), device],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"stage {stage_id} of {pipeline} did not build:\n{done.stderr[-2000:]}")
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    packages = import_breakdown(done.stderr)
    imported = set(packages)
    torch_us, own_us = packages.get("torch", 0), packages.get("omnistage", 0)
    import_ms = phases["import_s"] * 1e3
    return {
        "pipeline": pipeline,
        "stage": stage_id,
        "kind": phases["kind"],
        "import_ms": import_ms,
        "torch_ms": torch_us / 1e3,
        "omnistage_ms": own_us / 1e3,
        "other_ms": max(0.0, import_ms - (torch_us + own_us) / 1e3),
        "heavy": ",".join(p for p in HEAVY if p in imported) or "-",
        "build_ms": phases["build_s"] * 1e3,
        "top_packages": {p: us / 1e3 for p, us in packages.most_common(10)},
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_ms(pipeline: str, device: str, timeout_s: float = 120.0) -> tuple[float, float]:
    """``omnistage serve`` to ``/health`` 200, and to a 1-token chat answer (ms)."""
    port = _free_port()
    command = [sys.executable, "-m", "omnistage", "serve", "--pipeline", pipeline, "--device"]
    command += [device, "--port", str(port), "--log-level", "warning"]
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=30.0) as client:
            while True:
                if server.poll() is not None or time.perf_counter() - start > timeout_s:
                    raise RuntimeError(f"omnistage serve --pipeline {pipeline} did not get ready")
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
            ready = time.perf_counter()
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            body["modalities"] = ["text"]  # the first token, whatever else the pipeline makes
            client.post(f"{base}/v1/chat/completions", json=body).raise_for_status()
            answered = time.perf_counter()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return (ready - start) * 1e3, (answered - start) * 1e3


def bench_pipeline(pipeline: str, device: str, repeats: int) -> list[dict[str, Any]]:
    config = load_pipeline(pipeline, device=device)  # build tiny models outside the timings
    rows = [stage_row(pipeline, stage.stage_id, device) for stage in config.stages]
    first = statistics.median(cold_start_ms(pipeline, device) for _ in range(repeats))
    served = [serve_ms(pipeline, device) for _ in range(repeats)]
    for row in rows:
        row["first_token_ms"] = first
        row["serve_ready_ms"] = statistics.median(s[0] for s in served)
        row["serve_first_token_ms"] = statistics.median(s[1] for s in served)
    return rows


def run(
    out_dir: str,
    device: str = "cpu",
    pipelines: tuple[str, ...] = ("tiny-chat", "tiny-omni"),
    repeats: int = 3,
) -> str:
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    # An installed package has its bytecode; a fresh checkout compiles it on the first import,
    # which would land in whichever measurement imports first (the import breakdown).
    compileall.compile_dir(str(Path(omnistage.__file__).parent), quiet=1)
    name = f"coldstart-{device.replace(':', '')}"
    rows: list[dict[str, Any]] = []
    for pipeline in pipelines:
        rows += bench_pipeline(pipeline, device, repeats)
        write_results(out_dir, name, rows, COLUMNS)
    return write_results(out_dir, name, rows, COLUMNS)
