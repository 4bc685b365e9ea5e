"""The launch shapes users bring from vLLM and vLLM-Omni serve and answer: vLLM-Omni's
``python -m ...entrypoints.openai.api_server --model X --enable-sleep-mode`` and
``omnistage serve MODEL`` (positional, as ``vllm serve``)."""

from __future__ import annotations

import httpx
import pytest

from omnistage.models.ar_config import ARModelConfig
from omnistage.pipelines import load_pipeline
from tests.e2e.server import running_server


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return load_pipeline("tiny-chat").stages[0].model  # built on first use


@pytest.mark.parametrize(
    ("entry", "args"),
    [
        (("omnistage.entrypoints.openai.api_server",), ("--model", "{m}", "--enable-sleep-mode")),
        (("omnistage", "serve"), ("{m}", "--max-num-seqs", "4", "--dtype", "auto")),
    ],
    ids=["vllm-omni-api-server", "positional-model"],
)
def test_launch_shape_serves_a_chat(checkpoint, entry, args):
    argv = [a.format(m=checkpoint) for a in args]
    with running_server(*argv, entry=entry) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        (stage,) = httpx.get(server.url + "/v1/omni/stages", timeout=30).json()["stages"]
        assert stage["enable_sleep_mode"] == ("--enable-sleep-mode" in argv)
        # max_model_len was not given: the checkpoint's own limit applies
        limit = ARModelConfig.from_pretrained(checkpoint).max_position_embeddings
        too_long = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": list(range(1, 10)) * (limit // 9 + 1), "max_tokens": 1},
            timeout=60,
        )
        assert too_long.status_code == 400 and f"max_model_len={limit}" in too_long.text
