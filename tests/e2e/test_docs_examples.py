"""Every shell and Python example of the README and ``docs/`` that says it runs on a built-in
pipeline (``tests/docs_examples.py`` reads the blocks and their markers) runs as printed: one
server per pipeline, its examples in document order, each block a ``bash -e -o pipefail`` or a
``python`` process in a scratch folder. Only the address changes (``localhost:8000`` is the
test server's port; ``omnistage ctl`` reads it from ``$OMNISTAGE_URL``), and the lines that
start the server are the server already running. Each HTTP request a block makes (``curl``
reports its status on stderr through a wrapper that adds ``--write-out``) answers 2xx, or the
statuses its marker expects."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import ROOT, Example, examples, served_pipeline
from tests.e2e.server import running_server

RUNNABLE = [e for e in examples() if e.runs]
PIPELINES = sorted({e.pipeline for e in RUNNABLE})
ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")
STATUS = re.compile(r"^omnistage-docs HTTP (\d{3})$", re.M)


def _workdir(tmp_path: Path, url: str) -> tuple[Path, dict[str, str]]:
    """A scratch folder with the clone's ``.venv`` beside it (the README calls
    ``.venv/bin/omnistage``) and a ``curl`` that also writes each answer's status to stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = subprocess.run(["which", "curl"], capture_output=True, text=True, check=True)
    wrapper = bin_dir / "curl"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'exec {real.stdout.strip()} --write-out "%{{stderr}}omnistage-docs HTTP %{{http_code}}\\n" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), venv_bin, os.environ.get("PATH", "")]),
        "OMNISTAGE_URL": url,
        "PYTHONPATH": str(ROOT),
    }
    return tmp_path, env


def _script(example: Example, port: int) -> str:
    """The block as printed, at the test server's address, without its server-starting
    lines (which must serve the pipeline the marker names)."""
    kept = []
    for line in example.body.splitlines():
        served = served_pipeline(line) if example.language == "bash" else None
        if served is not None:
            assert served == example.pipeline, f"{example.where}: serves {served!r}"
            continue
        kept.append(ADDRESS.sub(f"127.0.0.1:{port}", line))
    return "\n".join(kept) + "\n"


def _run(example: Example, port: int, cwd: Path, env: dict[str, str]) -> str | None:
    """None when the block ran as its marker says; else what went wrong."""
    script = _script(example, port)
    if example.language == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", script]
    else:
        argv = [sys.executable, "-c", script]
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return f"{example.where}: still running after 180 s"
    statuses = [int(s) for s in STATUS.findall(done.stderr)]
    stderr = STATUS.sub("", done.stderr).strip()
    if done.returncode != 0:
        return f"{example.where}: exit {done.returncode}\n{done.stdout[-2000:]}\n{stderr[-2000:]}"
    if example.language == "bash" and len(statuses) < script.count("curl "):
        return f"{example.where}: {script.count('curl ')} curl calls, {len(statuses)} answers seen"
    expected = example.expected
    if expected is None:
        wrong = [s for s in statuses if not 200 <= s < 300]
    else:
        wrong = [] if statuses == expected else statuses
    if wrong:
        return f"{example.where}: HTTP {statuses} (expected {expected or '2xx'})\n{done.stdout[-2000:]}"
    return None


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_the_examples_run_as_printed(pipeline: str, tmp_path: Path) -> None:
    with running_server("--pipeline", pipeline, "--enable-sleep-mode") as server:
        port = int(server.url.rsplit(":", 1)[1])
        cwd, env = _workdir(tmp_path, server.url)
        failures = []
        for example in (e for e in RUNNABLE if e.pipeline == pipeline):
            failure = _run(example, port, cwd, env)
            if failure:
                failures.append(failure)
    assert not failures, "\n\n".join(failures)
