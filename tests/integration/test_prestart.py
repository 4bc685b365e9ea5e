"""``omnistage serve`` spawns its stages before it imports torch, and the launcher takes those
processes over; ones nobody takes are stopped."""

import subprocess
import sys

import pytest

from omnistage.engine.launcher import LocalProcessLauncher
from omnistage.engine.spawn import prestart
from omnistage.pipelines import load_pipeline
from omnistage.stage.startup import StartupOptions

# What run_server does up to the spawn, in a fresh interpreter: no torch imported by then.
_SERVER_START = """
import sys
from omnistage.entrypoints.cli_args import parse_serve_args
from omnistage.entrypoints.openai.api_server import resolve_pipeline
from omnistage.engine.spawn import prestart
config = parse_serve_args(["--pipeline", "tiny-chat"], "omnistage serve")
pipeline = resolve_pipeline(config, lambda m: None)
assert "torch" not in sys.modules, "torch imported before the stages were spawned"
spawned = prestart(pipeline)
for stage in spawned.values():
    stage.discard()
print("ok")
"""


def test_the_server_spawns_its_stages_before_importing_torch():
    load_pipeline("tiny-chat")  # built outside the subprocess
    done = subprocess.run(
        [sys.executable, "-c", _SERVER_START], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_the_launcher_takes_a_prestarted_stage_over_once():
    pipeline = load_pipeline("tiny-chat")
    stage = pipeline.stages[0]
    spawned = prestart(pipeline)
    process = spawned[stage.stage_id].process
    launcher = LocalProcessLauncher(lambda s: 1, ready_timeout_s=60, prestarted=spawned)
    handle = launcher.launch(stage, StartupOptions())
    try:
        assert handle.process is process and not launcher.prestarted
        assert handle.wait_ready().vocab_size > 0
    finally:
        handle.shutdown()
    assert not process.is_alive()
    # A restart (other options) spawns anew, as does a second launch.
    again = prestart(pipeline)
    launcher = LocalProcessLauncher(lambda s: 1, ready_timeout_s=60, prestarted=again)
    restarted = launcher.launch(stage, StartupOptions(paused=True))
    try:
        assert restarted.process is not again[stage.stage_id].process
    finally:
        restarted.shutdown()
        for left in again.values():
            left.discard()
            assert not left.process.is_alive()
