"""examples/rl_loop.py runs as shipped, both ways: a trainer and a served stage (over HTTP,
weights pushed over gloo), and a trainer with ``omnistage.LLM`` in its own process (weights
applied in place) — a real RL loop with omnistage's logprobs equal to the trainer's, the
rollouts' before each step and the prompt's after every weight update."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "mode, steps", [((), 2), (("--in-process",), 2)], ids=["http", "in-process"]
)
def test_the_rl_loop_example_runs_and_its_checks_hold(mode, steps):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), *mode, "--steps", str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == steps and all("checksums agree" in line for line in lines), done.stdout
