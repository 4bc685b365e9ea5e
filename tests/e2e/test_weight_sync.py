"""Weight sync without disk over a real server (one per module).

From a separate trainer process: gloo (the ``nccl`` backend on CPU) and shared memory
(``ipc``), three updates in a row, greedy outputs equal transformers on the updated weights,
the checksums agree, and a sync that fails half-way — the trainer killed mid-broadcast, a
wrong shape — leaves the old weights serving.

As hostile or careless trainers would call the routes, from this process: a second trainer
cannot mix into an open session (409 naming ``session``; concurrent syncs end with the
weights of the version reported), vLLM's id-less sequence still works and ``abort_open``
takes over; a dtype other than the weight's, a bad ``init_info``, a CUDA handle on a CPU
stage, a partial update and an unbounded ``weight_version`` are 400s naming the field; a
slow and then stalled trainer never stops the stage serving. After every case the checksum
and ``/get_weight_version`` are the old ones, or the new ones after a good sync."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from omnistage.rl import weights_checksum
from tests.e2e.server import running_server
from tests.e2e.trainer import perturbed_state
from tests.unit.models.hf_checkpoints import VOCAB, build_checkpoint
from tests.unit.stage.shared_tensors import Shared, describe

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


# -- hostile and careless trainers: raw protocol calls, in this process ----------------------
#
# After every case the serving weights (checksum) and version (/get_weight_version) are the
# old ones when a sync was refused, the new ones when it went through.


def post(server, path: str, body: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json={} if body is None else body, timeout=timeout)


def serving(server) -> tuple[str, str | None]:
    version = httpx.get(server.url + "/get_weight_version", timeout=30).json()["weight_version"]
    stage = httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"][0]
    assert (stage["weight_version"] or None) == version  # the stage and the replies agree
    return checksum(server), version


def refused(reply: httpx.Response, status: int, param: str) -> str:
    assert reply.status_code == status, reply.text[:500]
    assert reply.json()["error"]["param"] == param, reply.text[:500]
    return str(reply.json()["error"]["message"])


@pytest.fixture(scope="module")
def base_state(checkpoint) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def nudged(base: dict[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor]]:
    """``base`` moved a little, tied weights alike (what a training step would do)."""
    generator = torch.Generator().manual_seed(seed)
    noise: dict[tuple[object, ...], torch.Tensor] = {}
    out = []
    for name, tensor in sorted(base.items()):
        key = (tensor.sum().item(), *tensor.shape)  # tied tensors are equal
        if key not in noise:
            noise[key] = torch.randn(tensor.shape, generator=generator) * 0.05
        out.append((name, tensor + noise[key]))
    return out


@pytest.fixture
def shared():
    s = Shared()
    yield s
    s.close()


def init_ipc(server) -> None:
    """The ipc backend, no session open (one a failed test left is discarded)."""
    body = {"backend": "ipc", "abort_open": True}
    assert post(server, "/v1/omni/weights/init", body).status_code == 200


def test_two_trainers_cannot_mix_weights_under_one_version(server, base_state, shared):
    init_ipc(server)
    before = serving(server)
    mine = nudged(base_state, 1)
    start = {"update_info": describe(mine), "require_session": True}
    sid = post(server, "/v1/omni/weights/start", start).json()["session"]
    assert post(server, "/v1/omni/weights/update",
                {"update_info": shared.chunk(mine[:20]), "session": sid}).status_code == 200  # fmt: skip
    theirs = nudged(base_state, 2)
    # Another trainer: every way in is a 409 naming the session, and changes nothing.
    refused(
        post(server, "/v1/omni/weights/start", {"update_info": describe(theirs)}), 409, "session"
    )
    refused(post(server, "/start_weight_update"), 409, "session")
    for session in ({}, {"session": "forged"}):
        chunk = {"update_info": shared.chunk(theirs), **session}
        refused(post(server, "/v1/omni/weights/update", chunk), 409, "session")
        refused(post(server, "/update_weights", chunk), 409, "session")
        refused(
            post(server, "/finish_weight_update", {"weight_version": "B", **session}),
            409,
            "session",
        )
        refused(post(server, "/v1/omni/weights/abort", session), 409, "session")
    assert serving(server) == before
    rest = {"update_info": shared.chunk(mine[20:]), "session": sid}
    assert post(server, "/v1/omni/weights/update", rest).status_code == 200
    done = post(server, "/v1/omni/weights/finish", {"weight_version": "A", "session": sid})
    assert done.status_code == 200 and done.json()["status"] == "SUCCESS"
    assert serving(server) == (weights_checksum(mine), "A")


def test_concurrent_syncs_serve_the_weights_of_the_version_they_report(server, base_state):
    import concurrent.futures

    from omnistage.rl import WeightSender

    states = {f"c{i}": nudged(base_state, 100 + i) for i in range(8)}

    def sync(version: str) -> str:
        with WeightSender(server.url, backend="ipc") as sender:
            try:
                sender.send(states[version], weight_version=version)
            except Exception as exc:
                return str(exc)
        return "ok"

    init_ipc(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = dict(zip(states, pool.map(sync, states), strict=True))
    won = [v for v, outcome in outcomes.items() if outcome == "ok"]
    assert won, outcomes
    assert all("409" in o for o in outcomes.values() if o != "ok"), outcomes
    weights, version = serving(server)
    assert version in won and weights == weights_checksum(states[version])


def test_a_vllm_client_without_session_ids_syncs_and_abort_open_takes_over(
    server, base_state, shared
):
    init_ipc(server)
    first = post(server, "/start_weight_update")
    assert first.status_code == 200 and first.json()["session"]
    stale = nudged(base_state, 3)
    assert (
        post(server, "/update_weights", {"update_info": shared.chunk(stale[:5])}).status_code == 200
    )
    before = serving(server)
    # Its trainer went away: the next one says so and takes over.
    new = nudged(base_state, 4)
    start = {"update_info": describe(new), "require_session": True, "abort_open": True}
    sid = post(server, "/v1/omni/weights/start", start).json()["session"]
    refused(
        post(server, "/update_weights", {"update_info": shared.chunk(stale[5:])}), 409, "session"
    )
    assert (
        post(
            server, "/update_weights", {"update_info": shared.chunk(new), "session": sid}
        ).status_code
        == 200
    )
    assert serving(server) == before
    done = post(server, "/finish_weight_update", {"weight_version": "vllm-1", "session": sid})
    assert done.json()["status"] == "SUCCESS"
    assert serving(server) == (weights_checksum(new), "vllm-1")
    # The plain vLLM sequence, no ids anywhere.
    plain = nudged(base_state, 5)
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/update_weights", {"update_info": shared.chunk(plain)}).status_code == 200
    assert (
        post(server, "/finish_weight_update", {"weight_version": 6}).json()["status"] == "SUCCESS"
    )
    assert serving(server) == (weights_checksum(plain), "6")


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "float16", "float8_e4m3fn"])
def test_a_declared_dtype_other_than_the_weights_is_a_400(server, base_state, shared, dtype):
    init_ipc(server)
    before = serving(server)
    bad = [("lm_head.weight", base_state["lm_head.weight"].to(getattr(torch, dtype)))]
    param = "update_info.dtype_names.lm_head.weight"
    message = refused(
        post(server, "/v1/omni/weights/start", {"update_info": describe(bad)}), 400, param
    )
    assert dtype in message and "float32" in message
    assert post(server, "/v1/omni/weights/start").status_code == 200
    refused(post(server, "/v1/omni/weights/update", {"update_info": shared.chunk(bad)}), 400, param)
    refused(post(server, "/v1/omni/weights/finish", {"weight_version": "bad"}), 400, "session")
    assert serving(server) == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"backend": "nccl", "init_info": {"master_address": "127.0.0.1", "master_port": 29500,
                                           "timeout_s": -1}}, "init_info.timeout_s"),
        ({"backend": "nccl", "init_info": {"master_address": "127.0.0.1", "master_port": 29500,
                                           "timeout_s": 3600}}, "init_info.timeout_s"),
        ({"backend": "nccl", "init_info": {"master_address": "127.0.0.1", "master_port": 70000}},
         "init_info.master_port"),
        ({"backend": "nccl", "init_info": {"master_port": 29500}}, "init_info.master_address"),
        ({"backend": "gloo"}, "backend"),
    ],
)  # fmt: skip
def test_a_bad_init_info_is_a_400_and_the_transfer_stays(server, base_state, shared, body, param):
    init_ipc(server)
    before = serving(server)
    refused(post(server, "/v1/omni/weights/init", body), 400, param)
    assert serving(server) == before
    assert post(server, "/v1/omni/weights/start").status_code == 200  # ipc still initialised
    assert post(server, "/v1/omni/weights/abort").status_code == 200


def test_a_cuda_ipc_handle_on_a_cpu_stage_is_a_400(server, base_state):
    init_ipc(server)
    before = serving(server)
    assert post(server, "/v1/omni/weights/start").status_code == 200
    handle = {"cuda": {"device": 0, "handle": "AAAA", "storage_size": 4}}
    info = describe([("lm_head.weight", base_state["lm_head.weight"])], ipc_handles=[handle])
    message = refused(
        post(server, "/v1/omni/weights/update", {"update_info": info}),
        400,
        "update_info.ipc_handles",
    )
    assert "cpu" in message
    assert serving(server) == before


def test_a_partial_update_is_refused_at_finish(server, base_state, shared):
    init_ipc(server)
    before = serving(server)
    new = nudged(base_state, 6)
    sid = post(server, "/v1/omni/weights/start",
               {"update_info": describe(new), "require_session": True}).json()["session"]  # fmt: skip
    half = len(new) // 2
    chunk = {"update_info": shared.chunk(new[:half]), "session": sid}
    assert post(server, "/v1/omni/weights/update", chunk).status_code == 200
    finish = {"weight_version": "partial", "session": sid}
    message = refused(post(server, "/v1/omni/weights/finish", finish), 400, "update_info.names")
    assert f"{len(new) - half} of the {len(new)}" in message and new[half][0] in message
    assert serving(server) == before
    assert post(server, "/v1/omni/weights/start").status_code == 200  # that session is over
    assert post(server, "/v1/omni/weights/abort").status_code == 200


def test_a_weight_version_is_bounded(server, base_state, shared):
    init_ipc(server)
    before = serving(server)
    new = nudged(base_state, 7)
    sid = post(server, "/v1/omni/weights/start", {"require_session": True}).json()["session"]
    assert post(server, "/v1/omni/weights/update",
                {"update_info": shared.chunk(new), "session": sid}).status_code == 200  # fmt: skip
    for version in ("v" * 4_000_000, "v" * 129, "two words", "", "<script>"):
        reply = post(server, "/v1/omni/weights/finish", {"weight_version": version, "session": sid})
        assert len(refused(reply, 400, "weight_version")) < 200  # never echoed back
        assert serving(server) == before
    done = post(server, "/v1/omni/weights/finish", {"weight_version": "step-7", "session": sid})
    assert done.json()["status"] == "SUCCESS"  # the session outlived the refused versions
    assert serving(server) == (weights_checksum(new), "step-7")
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert reply.json()["system_fingerprint"] == "weights-step-7"


def test_a_checkpoint_loaded_from_disk_clears_the_trainers_version(
    server, checkpoint, base_state, shared
):
    """After ``update_weights`` from a file the weights are the file's, whatever version a
    trainer had pushed before: no reply may still name that version."""
    init_ipc(server)
    sid = post(server, "/v1/omni/weights/start", {"require_session": True}).json()["session"]
    chunk = {"update_info": shared.chunk(nudged(base_state, 11)), "session": sid}
    assert post(server, "/v1/omni/weights/update", chunk).status_code == 200
    done = post(server, "/v1/omni/weights/finish", {"weight_version": "step-11", "session": sid})
    assert done.json()["status"] == "SUCCESS" and serving(server)[1] == "step-11"
    reply = post(server, "/v1/omni/update_weights", {"stage_id": 0, "path": str(checkpoint)})
    assert reply.status_code == 200 and reply.json()["status"] == "SUCCESS", reply.text
    assert serving(server) == (weights_checksum(base_state.items()), None)
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=60).json()
    assert answer.get("system_fingerprint") != "weights-step-11"


class GlooTrainer:
    """Rank 0 of a gloo group with the stage, in this process. It asks the stage to init
    at once but joins the group, and broadcasts, only when the test says so (a trainer
    that is slow to come, then stalls)."""

    def __init__(self, server, timeout_s: float = 60.0) -> None:
        import concurrent.futures
        import datetime

        import torch.distributed as dist

        from tests.e2e.server import free_port

        port = free_port()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)  # fmt: skip
        info = {"master_address": "127.0.0.1", "master_port": port, "timeout_s": timeout_s}
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.init = self._pool.submit(
            post, server, "/v1/omni/weights/init", {"backend": "nccl", "init_info": info}
        )
        self.group = None

    def join(self) -> None:
        import torch.distributed as dist

        self.group = dist.ProcessGroupGloo(self.store, 0, 2, self.timeout)
        reply = self.init.result(60)
        assert reply.status_code == 200, reply.text
        self._pool.shutdown()

    def broadcast(self, named: list[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _, tensor in named:
            self.group.broadcast([tensor.contiguous()], opts).wait()  # type: ignore[attr-defined]


def until_busy_with(server, message: str) -> None:
    """Wait — deterministically: the state lasts until the test ends it — until the stage
    says it is busy with ``message`` in the background. The probe, an abort without a
    session id, changes nothing here: no session is open, or the open one requires its id."""
    deadline = time.monotonic() + 60
    while True:
        reply = post(server, "/v1/omni/weights/abort")
        assert reply.status_code in (400, 409), reply.text
        if message in reply.json()["error"]["message"]:
            return
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.05)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_slow_then_stalled_trainer_never_stops_the_stage_serving(server, base_state):
    import concurrent.futures

    before = serving(server)
    trainer = GlooTrainer(server, timeout_s=60)
    # The stage waits (up to 60 s) for the trainer to join, and serves meanwhile.
    until_busy_with(server, "still joining the trainer")
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    trainer.join()
    new = nudged(base_state, 8)
    sid = post(server, "/v1/omni/weights/start",
               {"update_info": describe(new), "require_session": True}).json()["session"]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The stage waits (up to 60 s) for a broadcast the trainer does not send yet...
        update = pool.submit(post, server, "/v1/omni/weights/update",
                             {"update_info": describe(new), "session": sid}, 120)  # fmt: skip
        until_busy_with(server, "still being received")
        # ...and serves meanwhile, on the old weights.
        reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert reply.status_code == 200, reply.text
        assert serving(server) == before
        refused(post(server, "/v1/omni/weights/start", {"abort_open": True}), 409, "session")
        # A finish sent now waits for the chunk: it cannot answer before the broadcast.
        finish = pool.submit(post, server, "/v1/omni/weights/finish",
                             {"weight_version": "after-stall", "session": sid}, 120)  # fmt: skip
        assert not update.done() and not finish.done()
        trainer.broadcast(new)
        assert update.result(60).status_code == 200
        assert finish.result(60).json()["status"] == "SUCCESS"
    assert serving(server) == (weights_checksum(new), "after-stall")


def test_a_trainer_that_is_not_there_is_a_400_in_time_and_chat_goes_on(server):
    """A rendezvous nobody joins is the caller's problem: a 400 naming it, within a second of
    its timeout_s; chat is served meanwhile."""
    import concurrent.futures

    from tests.e2e.server import free_port

    before = serving(server)
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "timeout_s": 3}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        init = pool.submit(
            post, server, "/v1/omni/weights/init", {"backend": "nccl", "init_info": info}
        )
        chat = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert chat.status_code == 200 and not init.done()
        reply = init.result(30)
        assert time.monotonic() - began < 4
    message = refused(reply, 400, "init_info")
    assert f"127.0.0.1:{port}" in message and "timeout_s=3" in message
    assert serving(server) == before
