"""The GPU validation kit (scripts/gpu-wheels.sh, scripts/gpu-check.sh) cannot rot: its
pinned wheel list matches the versions the tests run with, downloaded wheels fit the offline
GPU machine (CPython 3.12, manylinux x86-64), and the check script runs here as a CPU dry run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
WHEELS_SCRIPT = ROOT / "scripts" / "gpu-wheels.sh"
CHECK_SCRIPT = ROOT / "scripts" / "gpu-check.sh"
CARRY_LIMIT = 64 * 2**20
# What the issue names as missing on the GPU machine: all must be carried.
MISSING_ON_GPU_MACHINE = {
    "pydantic",
    "pydantic-core",
    "fastapi",
    "starlette",
    "uvicorn",
    "pyzmq",
    "msgspec",
    "diffusers",
    "openai",
    "pytest-asyncio",
    "pytest-timeout",
}
DRY_RUN_FILES = {
    "summary.md",
    "setup.log",
    "gpu-tests.log",
    "bench.log",
    "arena-cpu.json",
    "arena-cpu.md",
    "control-cpu.json",
    "control-cpu.md",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> dict[str, str]:
    """The `PACKAGES=( ... )` array of gpu-wheels.sh: one `name==version` a line."""
    text = WHEELS_SCRIPT.read_text()
    block = re.search(r"^PACKAGES=\($(.*?)^\)$", text, re.M | re.S)
    assert block, "PACKAGES=( ... ) not found in scripts/gpu-wheels.sh"
    pins: dict[str, str] = {}
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
        assert match, f"not a name==version line: {line!r}"
        name = normalize(match.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = match.group(2)
    return pins


def project_requirements() -> dict[str, Requirement]:
    """The project's own requirements (runtime and dev), by normalized name."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*data["dependencies"], *data["optional-dependencies"]["dev"]]
    return {normalize(r.name): r for r in map(Requirement, specs)}


def test_wheel_list_pins_versions_the_project_accepts():
    """Every pin satisfies the project's own range; a pin that differs from what this venv
    runs with is reported (upstream moved on), not failed: re-pin with the versions the tests
    use before the next GPU run."""
    pins = pinned()
    missing = MISSING_ON_GPU_MACHINE - set(pins)
    assert not missing, missing
    requirements = project_requirements()
    refused = {
        name: (version, str(requirements[name].specifier))
        for name, version in pins.items()
        if name in requirements and version not in requirements[name].specifier
    }
    assert not refused, f"pins outside the project's ranges: {refused}"
    moved = {}
    for name, version in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            moved[name] = (version, installed)
    if moved:
        warnings.warn(f"gpu-wheels.sh pins differ from this venv: {moved}", stacklevel=1)
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


def _max_glibc(platform_tag: str) -> tuple[int, int] | None:
    """The glibc a manylinux x86-64 tag needs; None for any other platform."""
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    match = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_x86_64", platform_tag)
    if match:
        return legacy[match.group(1)]
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", platform_tag)
    return (int(match.group(1)), int(match.group(2))) if match else None


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory) -> Path:
    """``.whl/`` if this checkout has one, else a fresh download by scripts/gpu-wheels.sh
    (about 14 MiB from the package registry; skipped only when the registry is unreachable)."""
    if sorted((ROOT / ".whl").glob("*.whl")):
        return ROOT / ".whl"
    folder = tmp_path_factory.mktemp("gpu") / "whl"
    env = {**os.environ, "WHEELS": str(folder)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", str(WHEELS_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        output = done.stdout + done.stderr
        offline = ("NewConnectionError", "name resolution", "Could not fetch URL", "Network is")
        if any(sign in output for sign in offline):
            pytest.skip(f"the package registry is unreachable: {output[-300:]}")
        raise AssertionError(f"gpu-wheels.sh failed:\n{output[-3000:]}")
    return folder


def test_downloaded_wheels_fit_the_gpu_machine(wheel_folder):
    wheels = sorted(wheel_folder.glob("*.whl"))
    pins = pinned()
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, version, *_, python, abi, platform = wheel.name[: -len(".whl")].split("-")
        name = normalize(name)
        assert name not in seen, f"two wheels of {name}"
        seen[name] = version
        assert set(python.split(".")) & {"cp312", "py3"}, wheel.name
        assert set(abi.split(".")) & {"cp312", "abi3", "none"}, wheel.name
        if platform != "any":
            glibcs = [_max_glibc(p) for p in platform.split(".")]
            assert any(g is not None and g <= (2, 28) for g in glibcs), wheel.name
    assert seen == pins, "the wheels in .whl/ are not the pinned list"
    assert sum(w.stat().st_size for w in wheels) < CARRY_LIMIT


def test_gpu_tests_live_in_files_the_check_script_collects():
    """gpu-check.sh collects ``tests/**/*_gpu.py`` only: a GPU-marked test elsewhere would
    never run on the GPU machine."""
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    }
    assert marked and all(name.endswith("_gpu.py") for name in marked), marked


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no-wheels"
    empty.mkdir()
    env = dict(os.environ)
    # `python3` in the script must be this venv's interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(DEVICE="cpu", OUT=str(out), WHEELS=str(empty))
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(CHECK_SCRIPT)],
        cwd=tmp_path,  # the script finds the checkout from its own path
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=280,
    )
    elapsed = time.monotonic() - start
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log"))
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"

    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8
    assert {p.relative_to(out).as_posix() for p in files} == DRY_RUN_FILES
    assert all(p.stat().st_size < 64 * 1024 for p in files)

    summary = (out / "summary.md").read_text()
    assert "result: passed" in summary
    assert "| install | skipped: no wheels" in summary  # and it said so
    assert "imports: ok" in (out / "setup.log").read_text()
    assert "torch " in (out / "setup.log").read_text()
    tests_log = (out / "gpu-tests.log").read_text()
    assert re.search(r"\d+ skipped", tests_log) and "rc=0" in tests_log
    assert not re.search(r"\d+ (failed|error)", tests_log)

    arena = json.loads((out / "arena-cpu.json").read_text())
    assert arena["env"]["torch"]
    assert [(r["size_mib"], r["offload"]) for r in arena["rows"]] == [(16, "move"), (16, "copy")]
    row = arena["rows"][0]
    for key in ("copy_out_gbps", "copy_in_gbps", "offload_sleep_gbps", "offload_wake_gbps"):
        assert row[key] > 0, key
    assert row["sleep_vs_copy"] > 0 and row["wake_vs_copy"] > 0
    assert row["bit_exact"] is True and row["discard_rss_freed_mib"] > 0
    assert {"rss_freed_mib", "discard_sleep_ms", "discard_wake_ms"} <= set(row)
    arena_header = (out / "arena-cpu.md").read_text().splitlines()[0]
    for column in ("copy_out_gbps", "sleep_vs_copy", "copy_in_gbps", "wake_vs_copy"):
        assert f" {column} " in arena_header, column
    control = json.loads((out / "control-cpu.json").read_text())
    assert [(r["pipeline"], r["level"]) for r in control["rows"]] == [
        ("tiny-chat", 1),
        ("tiny-chat", 2),
    ]
    assert all(r["freed_mib"] > 0 and r["cold_start_ms"] > 0 for r in control["rows"])
    # No CUDA graphs on the host; the greedy decode is the same before sleep and after wake.
    assert all(r["cuda_graph_recalled"] is False for r in control["rows"])
    assert all(r["same_output"] is True for r in control["rows"])
    control_header = (out / "control-cpu.md").read_text().splitlines()[0]
    assert " cuda_graph_recalled | same_output " in control_header
    assert "| tiny-chat | 1 |" in summary and "| 16 |" in summary
    print(f"gpu-check.sh dry run: {elapsed:.1f} s")
