"""Server process lifecycle: stage death shows in /health, no orphans on any exit path."""

import os
import signal
import time

import httpx
import psutil

from tests.e2e.server import running_server


def alive(pids: list[int]) -> list[int]:
    return [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def test_health_turns_503_within_2s_of_a_stage_death_and_ctrl_c_leaves_no_child():
    with running_server("--pipeline", "tiny-chat") as server:
        children = server.stage_pids()
        assert children
        stage_pid = httpx.get(server.url + "/v1/omni/stages").json()["stages"][0]["pid"]
        os.kill(stage_pid, signal.SIGKILL)
        start = time.monotonic()
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() - start < 2.0, "health did not turn 503 within 2 s"
            time.sleep(0.05)
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and "dead" in r.text
        server.process.send_signal(signal.SIGINT)
        server.process.wait(20)
    assert wait_gone(children) == []


def test_killed_api_server_takes_its_stages_with_it():
    with running_server("--pipeline", "tiny-chat") as server:
        children = server.stage_pids()
        server.process.kill()
        server.process.wait(10)
        assert wait_gone(children) == []


def test_bad_settings_fail_before_serving_with_one_clear_line(tmp_path):
    import subprocess
    import sys

    cases = [
        (["--model", str(tmp_path / "missing")], "model: no such checkpoint folder"),
        (["--pipeline", "tiny-chat", "--device", "tpu"], "stages.0.device"),
        (
            ["--pipeline", "tiny-chat", "--idle-sleep-s", "5"],
            "idle_sleep_s needs enable_sleep_mode",
        ),
    ]
    for args, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "omnistage.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr


def test_a_port_in_use_fails_before_any_stage_starts_naming_it():
    """It was found after every stage had loaded (11.8 s on a tiny model; minutes on a real
    one) and reported only by uvicorn's [Errno 98] line and exit 3."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "omnistage.cli", "serve", "--pipeline", "tiny-chat",
             "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr and "stage" not in done.stdout.lower()
    assert elapsed < 10, elapsed  # no stage was started
