"""No request, however malformed, answers 500, hangs, or takes a stage down.

A table of hostile bodies is sent to every route of the shared tiny-omni server; afterwards
every stage is alive (no restart happened) and a normal request gives the same greedy
output as before. Each numbered case of the robustness review has its own regression test.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.conftest import CONTROL_KEY

GREEDY = {"temperature": 0.0, "max_tokens": 8}
DATA_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/images/generations"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
]
# Bodies that fail validation on every control route (valid ones would really pause or sleep).
CONTROL_ROUTES = [
    ("POST", "/v1/omni/sleep"),
    ("POST", "/v1/omni/wakeup"),
    ("POST", "/v1/omni/pause"),
    ("POST", "/v1/omni/resume"),
    ("POST", "/v1/omni/update_weights"),
    ("GET", "/v1/omni/stages"),
    ("GET", "/is_sleeping"),
    ("GET", "/is_paused"),
]
GENERIC_BODIES: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b"5",
    b'"text"',
    b"\xff\xfe\xfa not utf-8",
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    b'{"stage_ids": [1e999], "messages": 1e999, "prompt": -1e999}',
    b'{"stage_ids": ["0"], "level": true, "mode": 3, "tags": "weights", "path": [], '
    b'"stage_id": 1e30}',
    json.dumps({"stage_ids": [10**30], "level": 10**30, "stage_id": -(10**30)}).encode(),
    json.dumps({"x" * 10_000: "y" * 1_000_000}).encode(),
]
CHAT = "/v1/chat/completions"
DATA_BODIES: list[tuple[str, dict]] = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": 1e-300}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-300}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e300}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "seed": -(2**70)}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_k": -5}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_k": 10**30}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": [""]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [-1]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [2**70]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user", "content": None}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 4}),
    (
        CHAT,
        {
            "messages": [{"role": "user", "content": "draw"}],
            "modalities": ["text", "image"],
            "size": "4096x4096",
        },
    ),
    (
        CHAT,
        {
            "messages": [{"role": "user", "content": "draw"}],
            "modalities": ["text", "image"],
            "num_inference_steps": 10**9,
        },
    ),
    ("/v1/completions", {"prompt": [10**9, -1], "max_tokens": 4}),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}),
    ("/v1/completions", {"prompt": [2**70], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}),
    ("/v1/images/generations", {"prompt": "a cat", "size": "4096x4096"}),
    ("/v1/images/generations", {"prompt": "a cat", "size": "0x0"}),
    ("/v1/images/generations", {"prompt": "a cat", "size": "64x-64"}),
    ("/v1/images/generations", {"prompt": "a cat", "size": "63x64"}),
    ("/v1/images/generations", {"prompt": "a cat", "n": 10**6}),
    ("/v1/images/generations", {"prompt": "a cat", "seed": 2**70}),
    ("/v1/images/generations", {"prompt": "a cat", "guidance_scale": float("inf")}),
]


def control_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {CONTROL_KEY}", "Content-Type": "application/json"}


def greedy_text(server) -> str:
    r = httpx.post(
        server.url + CHAT,
        json={"messages": [{"role": "user", "content": "same as before"}], **GREEDY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def stage_restarts(server) -> list[int]:
    r = httpx.get(server.url + "/v1/omni/stages", headers=control_headers(), timeout=30)
    return [s["restarts"] for s in r.json()["stages"]]


def send(server, method: str, path: str, content: bytes, headers: dict) -> httpx.Response:
    return httpx.request(method, server.url + path, content=content, headers=headers, timeout=60)


def test_hostile_bodies_on_every_route_never_answer_500_or_take_a_stage_down(omni_server):
    before = greedy_text(omni_server)
    restarts = stage_restarts(omni_server)
    problems = []
    cases = [
        (m, p, b, {"Content-Type": "application/json"})
        for m, p in DATA_ROUTES
        for b in GENERIC_BODIES
    ]
    cases += [(m, p, b, control_headers()) for m, p in CONTROL_ROUTES for b in GENERIC_BODIES]
    cases += [("POST", p, json.dumps(b).encode(), {}) for p, b in DATA_BODIES]
    for method, path, body, headers in cases:
        try:
            r = send(omni_server, method, path, body, headers)
        except httpx.TimeoutException:
            problems.append(f"{method} {path} {body[:60]!r}: hang")
            continue
        if r.status_code >= 500:
            problems.append(f"{method} {path} {body[:60]!r}: {r.status_code} {r.text[:200]}")
    assert not problems, "\n".join(problems)
    assert httpx.get(omni_server.url + "/health").status_code == 200
    assert stage_restarts(omni_server) == restarts  # no stage died on the way
    assert greedy_text(omni_server) == before


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 4, "top_p": 1e-300},
        {"max_tokens": 4, "top_p": 1e-45, "temperature": 1.9},
        {"max_tokens": 4, "temperature": 1e-5, "top_k": 1},
    ],
)
def test_case1_extreme_sampling_parameters_sample(omni_server, body):
    r = httpx.post(
        omni_server.url + CHAT,
        json={"messages": [{"role": "user", "content": "hi"}], **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_case4_an_oversized_body_is_refused_before_anyone_reads_it(omni_server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000_000}]}).encode()
    r = httpx.post(omni_server.url + CHAT, content=body, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(60):
            yield b"x" * 1_000_000
        yield b'"}]}'

    r = httpx.post(omni_server.url + CHAT, content=chunks(), timeout=60)  # no Content-Length
    assert r.status_code == 413


def test_case4_a_prompt_longer_than_the_model_is_refused_naming_it(omni_server):
    r = httpx.post(
        omni_server.url + "/v1/completions",
        json={"prompt": "word " * 4000, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "This model's maximum context length is" in r.json()["error"]["message"]


def test_an_answer_of_hundreds_of_mb_is_refused_up_front(omni_server):
    """n=128 samples of ~450 prompt tokens with the top-20 prompt logprobs each: 1.2 M entries,
    a reply of ~80 MB (the 2.7 M of one such request made 175 MiB and took the API process
    from 251 to 716 MiB). A 400 naming the limit, before any stage works."""
    body = {"prompt": "word " * 150, "n": 128, "prompt_logprobs": 20, "max_tokens": 2}
    r = httpx.post(omni_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and "max_answer_logprobs" in error["message"]
    ok = {"prompt": "word " * 150, "n": 2, "prompt_logprobs": 2, "max_tokens": 2}
    assert httpx.post(omni_server.url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_a_big_prompt_never_stalls_the_event_loop(omni_server):
    """A chat of ~4 MB (under the body limit) is refused by its length before any tokenizing
    (a tokenizer held the event loop 7 s for one), while /health keeps answering."""
    import threading

    body = {"messages": [{"role": "user", "content": "word " * 780_000}], "max_tokens": 2}
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: result.update(r=httpx.post(omni_server.url + CHAT, json=body, timeout=120))
    )
    health_ms: list[float] = []
    sender.start()
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(omni_server.url + "/health", timeout=30).status_code == 200
        health_ms.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.01)
    sender.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "messages"
    assert "max_model_len" in result["r"].json()["error"]["message"]
    assert max(health_ms, default=0.0) < 1000, health_ms  # generous: a few ms when idle


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a cat", "size": "4096x4096"}, "size"),
        ({"prompt": "a cat", "num_inference_steps": 1000}, "num_inference_steps"),
    ],
)
def test_case5_image_limits_answer_400_up_front(omni_server, body, param):
    r = httpx.post(omni_server.url + "/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_case8_the_schema_follows_the_data_key_and_no_cdn_page_is_offered(omni_server):
    assert httpx.get(omni_server.url + "/openapi.json").status_code == 200  # no --api-key
    assert httpx.get(omni_server.url + "/docs").status_code == 404
    assert httpx.get(omni_server.url + "/redoc").status_code == 404


def _bad_checkpoints(tmp_path) -> dict[str, str]:
    """Paths an operator might push by mistake (or on purpose), one per kind of fault."""
    import struct

    import torch
    from safetensors.torch import save_file

    def raw(name: str, data: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(data)
        return str(path)

    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}})
    (tmp_path / "folder").mkdir()
    (tmp_path / "no-map").mkdir()
    (tmp_path / "no-map" / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "shard-1.safetensors"}})
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    save_file({"not.a.tensor.of.this.model": torch.zeros(3)}, tmp_path / "unknown.safetensors")
    save_file({}, tmp_path / "empty-tensors.safetensors")
    return {
        "passwd": "/etc/passwd",
        "folder": str(tmp_path / "folder"),
        "proc": "/proc/self/mem",
        "dangling": str(tmp_path / "dangling"),
        "empty": raw("empty.safetensors", b""),
        "bad-json": raw("bad.safetensors", struct.pack("<Q", 5) + b"{nope"),
        "past-the-end": raw("short.safetensors", struct.pack("<Q", len(header)) + header.encode()),
        "no-weight-map": str(tmp_path / "no-map"),
        "missing-shard": str(tmp_path / "missing"),
        "unknown-keys": str(tmp_path / "unknown.safetensors"),
        "zero-tensors": str(tmp_path / "empty-tensors.safetensors"),
        "long-path": "/" + "x" * 100_000,
    }


@pytest.mark.parametrize("stage_id", [0, 1])
def test_case3_a_bad_checkpoint_is_a_400_naming_the_path_and_the_stage_keeps_serving(
    omni_server, tmp_path, stage_id
):
    before = greedy_text(omni_server)
    restarts = stage_restarts(omni_server)
    for name, path in _bad_checkpoints(tmp_path).items():
        r = httpx.post(
            omni_server.url + "/v1/omni/update_weights",
            json={"stage_id": stage_id, "path": path},
            headers=control_headers(),
            timeout=60,
        )
        assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:300]}"
        assert r.json()["error"]["param"] == "path", name
    assert stage_restarts(omni_server) == restarts
    assert greedy_text(omni_server) == before


def test_case2_nan_weights_are_refused_and_the_old_ones_keep_serving(omni_server, tmp_path):
    import torch
    from safetensors.torch import save_file

    from omnistage.models.loader import SafetensorsFile
    from omnistage.pipelines import cache_dir

    before = greedy_text(omni_server)
    with SafetensorsFile(cache_dir() / "demo" / "model.safetensors") as st:
        name = next(k for k in st.keys() if k.endswith("down_proj.weight"))  # noqa: SIM118
        shape = st.tensor(name).shape
    save_file({name: torch.full(shape, float("nan"))}, tmp_path / "nan.safetensors")
    r = httpx.post(
        omni_server.url + "/v1/omni/update_weights",
        json={"stage_id": 0, "path": str(tmp_path / "nan.safetensors")},
        headers=control_headers(),
        timeout=60,
    )
    assert r.status_code == 400 and "non-finite" in r.json()["error"]["message"], r.text
    assert greedy_text(omni_server) == before


def test_case5_a_request_whose_client_left_stops_at_the_next_step(omni_server):
    """The image stage drops a request at the next denoising step once its client is gone."""
    body = {"prompt": "a slow cat", "size": "256x256", "num_inference_steps": 200}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(omni_server.url + "/v1/images/generations", json=body, timeout=1.5)
    gone = time.monotonic()

    def image_stage() -> dict:
        r = httpx.get(omni_server.url + "/v1/omni/stages", headers=control_headers(), timeout=30)
        return r.json()["stages"][1]

    while image_stage()["num_running"] or image_stage()["in_flight"]:
        assert time.monotonic() - gone < 5.0, "the batch kept running for a client that left"
        time.sleep(0.05)
    assert image_stage()["num_batches"] >= 1  # it was running, and stopped
