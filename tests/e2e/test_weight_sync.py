"""Weight sync without disk from a separate trainer process, over a real server: gloo (the
``nccl`` backend on CPU) and shared memory (``ipc``), three updates in a row, greedy
outputs equal transformers on the updated weights, the checksums agree, and a sync that
fails half-way — the trainer killed mid-broadcast, a wrong shape — leaves the old weights
serving."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.server import running_server
from tests.e2e.trainer import perturbed_state
from tests.unit.models.hf_checkpoints import VOCAB, build_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    _, folder = build_checkpoint("qwen2-tied", tmp_path_factory.mktemp("sync-model"))
    return folder


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server("--model", str(checkpoint), "--enable-sleep-mode") as server:
        yield server


def trainer(
    server, checkpoint, backend: str, mode: str, steps: int = 3
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.e2e.trainer",
            server.url,
            str(checkpoint),
            backend,
            mode,
            str(steps),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def completion_text(server) -> str:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def expected_text(checkpoint: Path, state: dict[str, torch.Tensor] | None) -> str:
    import transformers

    from omnistage.models.tokenizer import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        )[0, len(PROMPT):].tolist()  # fmt: skip
    return Tokenizer.from_pretrained(checkpoint).decode(ids)


def checksum(server) -> str:
    r = httpx.get(server.url + "/v1/omni/weights/checksum", params={"stage_id": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["checksum"])


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_three_syncs_in_a_row_serve_the_trainers_weights(server, checkpoint, backend):
    done = trainer(server, checkpoint, backend, "sync")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["status"] for r in results] == ["SUCCESS"] * 3
    assert [r["version"] for r in results] == ["0", "1", "2"]
    assert all(r["checksum_ok"] for r in results)
    assert completion_text(server) == expected_text(checkpoint, perturbed_state(str(checkpoint), 2))
    stage = httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"][0]
    assert stage["weight_version"] == "2"
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert reply.json()["system_fingerprint"] == "weights-2"


def test_a_trainer_killed_mid_broadcast_leaves_the_old_weights_serving(server, checkpoint):
    before_text, before_sum = completion_text(server), checksum(server)
    done = trainer(server, checkpoint, "nccl", "die")
    assert done.returncode == 3, done.stderr[-3000:]
    assert completion_text(server) == before_text
    assert checksum(server) == before_sum
    again = trainer(server, checkpoint, "nccl", "sync", steps=1)  # a new group works
    assert again.returncode == 0, again.stderr[-3000:]
    assert completion_text(server) == expected_text(checkpoint, perturbed_state(str(checkpoint), 0))


def test_a_wrong_shape_is_refused_before_anything_moves(server, checkpoint):
    done = trainer(server, checkpoint, "ipc", "bad-shape", steps=1)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert "400" in results[-1]["bad"] and "up_proj" in results[-1]["bad"]
    assert completion_text(server) == expected_text(checkpoint, perturbed_state(str(checkpoint), 0))
