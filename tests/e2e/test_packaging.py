"""``pip install .`` without extras, into a fresh virtual environment, serves every built-in
pipeline's kind of stage: the image pipeline (its T5 text encoder comes from transformers,
a runtime dependency) builds its model and answers. Slow (a venv and its packages, ~1-2
min): the price of knowing the declared dependencies are the real ones."""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import running_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def share_torch(venv: Path, folder: Path) -> None:
    """This environment's torch, seen by the clean one through a ``.pth`` line: pip finds it
    installed (and installs what it needs) instead of unpacking the same 900 MB wheel again
    (half a minute of a CI run). Everything else comes from ``pip install .``."""
    import torch

    site = Path(torch.__file__).resolve().parents[1]
    for entry in site.iterdir():
        if entry.name.split("-")[0] in ("torch", "torchgen", "functorch"):
            (folder / entry.name).symlink_to(entry)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "shared-torch.pth").write_text(f"{folder}\n")


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("clean-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    share_torch(venv, tmp_path_factory.mktemp("torch"))
    # Not editable, no extras: what a user's `pip install .` gets. A copy, so no build
    # folder lands in the checkout.
    source = tmp_path_factory.mktemp("source") / "omnistage"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv*", ".git", ".whl", ".omnistage-cache", "bench-results", "*.egg-info", "build"
        ),
    )
    # --no-compile: the ~4000 modules of the dependencies are not byte-compiled up front (half
    # of the install's minute); the server compiles what it imports.
    done = subprocess.run(
        [*pip, "-v", "--no-compile", str(source)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return venv, done.stdout + done.stderr


def test_the_build_has_no_license_warnings(clean_venv):
    _, output = clean_venv
    warnings = [
        line for line in output.splitlines() if "license" in line.lower() and "warn" in line.lower()
    ]
    assert not warnings, warnings


def test_a_plain_install_serves_the_image_pipeline(clean_venv, tmp_path):
    venv, _ = clean_venv
    env = {"OMNISTAGE_CACHE_DIR": str(tmp_path / "models")}  # built here, by this install
    with running_server(
        "--pipeline", "tiny-image", python=str(venv / "bin" / "python"), env=env
    ) as server:
        r = httpx.post(
            server.url + "/v1/images/generations",
            json={"prompt": "a red square", "size": "64x64", "num_inference_steps": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG")
        page = httpx.get(server.url + "/ui/")  # the console's files are package data
        assert page.status_code == 200 and "static/app.js" in page.text
        assert httpx.get(server.url + "/ui/static/console.js").status_code == 200
