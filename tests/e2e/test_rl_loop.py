"""The RL post-training recipe over HTTP, with a changed checkpoint pushed in between."""

import shutil

import httpx
import torch
from safetensors.torch import load_file, save_file

from omnistage import LLM, SamplingParams
from omnistage.pipelines import cache_dir

PROMPT = [{"role": "user", "content": "tell me something"}]


def control(server, path, body):
    r = httpx.post(server.url + path, json=body, headers=server.control_headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_tokens(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": PROMPT, "temperature": 0.0, "max_tokens": 12},
        timeout=60,
    )
    return r


def test_pause_sleep_update_wake_resume(omni_server, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(cache_dir() / "demo", changed)
    state = load_file(str(changed / "model.safetensors"))
    generator = torch.Generator().manual_seed(123)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.ndim == 2 else v
        for k, v in state.items()
    }
    save_file(state, str(changed / "model.safetensors"))

    before = chat_tokens(omni_server).json()["choices"][0]["message"]["content"]
    control(omni_server, "/v1/omni/pause", {"stage_ids": [0]})
    control(omni_server, "/v1/omni/sleep", {"stage_ids": [0], "level": 2})
    control(
        omni_server,
        "/v1/omni/wakeup",
        {"stage_ids": [0], "tags": ["weights"], "reload": False, "resume": False},
    )
    refused = chat_tokens(omni_server)
    assert refused.status_code in (400, 409, 503), refused.text
    control(
        omni_server,
        "/v1/omni/update_weights",
        {"stage_id": 0, "path": str(changed / "model.safetensors")},
    )
    control(omni_server, "/v1/omni/wakeup", {"stage_ids": [0], "tags": ["kv_cache"]})
    control(omni_server, "/v1/omni/resume", {"stage_ids": [0]})
    after = chat_tokens(omni_server)
    assert after.status_code == 200, after.text
    text_after = after.json()["choices"][0]["message"]["content"]

    reference = LLM(model=str(changed), enable_sleep_mode=False)
    expected = (
        reference.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    )
    assert text_after == expected
    assert text_after != before

    # put the original weights back for the other tests
    control(
        omni_server, "/v1/omni/update_weights", {"stage_id": 0, "path": str(cache_dir() / "demo")}
    )
