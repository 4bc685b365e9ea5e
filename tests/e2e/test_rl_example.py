"""examples/rl_loop.py runs as shipped: a trainer and a served stage in a real RL loop,
with omnistage's logprobs equal to the trainer's after every weight sync."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_rl_loop_example_runs_and_its_checks_hold():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("checksums agree" in line for line in steps), done.stdout
