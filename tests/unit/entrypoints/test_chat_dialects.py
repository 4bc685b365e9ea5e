"""The chat route's two reply shapes (OpenAI's and vLLM-Omni's), the rule that picks one, the
default modalities, and image generation through chat on a pipeline that starts with a
diffusion stage — over a scripted engine client (the real stages: tests/e2e)."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from omnistage.engine.outputs import OmniAudio, OmniImage, OmniRequestOutput
from omnistage.entrypoints.openai.api_server import build_app, init_app_state
from omnistage.entrypoints.openai.server_config import ServerConfig

PNG = b"\x89PNG fake"
RATE = 24000


class ScriptedEngine:
    """Answers a request with "hi" from stage 0, then a picture and speech (in two pieces)
    for the modalities asked; records each call."""

    def __init__(self, produces: tuple[str, ...] = ("text", "image", "audio")) -> None:
        self.produces = produces
        self.calls: list[dict[str, Any]] = []
        self.router = self  # takes_messages() asks the first stage's preparer
        self.PROMPT_FIELDS = ("messages",) if "text" in produces else ("prompt",)

    def preparer(self, stage_id: int) -> Any:
        return self

    def output_modalities(self) -> list[str]:
        return list(self.produces)

    def plan(self, modalities: list[str] | None) -> list[int]:
        return [0]

    def generate(self, prompt: Any, sampling: Any, modalities: Any, **params: Any) -> Any:
        self.calls.append(
            {"prompt": prompt, "sampling": sampling, "modalities": modalities, **params}
        )
        return self._outputs(list(modalities))

    async def _outputs(self, modalities: list[str]) -> AsyncIterator[OmniRequestOutput]:
        def out(modality: str, **kw: Any) -> OmniRequestOutput:
            return OmniRequestOutput("r", 0, modality, num_prompt_tokens=3, **kw)

        last = modalities[-1]
        if "text" in modalities:
            yield out("text", text_delta="h", new_token_ids=[1])
            yield out("text", text_delta="i", new_token_ids=[2], finished=True,
                      finish_reason="stop", num_output_tokens=2, final=last == "text")  # fmt: skip
        if "image" in modalities:
            image = OmniImage(png=PNG, width=8, height=8, seed=1)
            yield out("image", finished=True, media=[image], final=last == "image",
                      finish_reason="stop")  # fmt: skip
        if "audio" in modalities:
            pieces = [OmniAudio(np.full(4, 0.25, np.float32), RATE) for _ in range(2)]
            whole = OmniAudio(np.full(8, 0.25, np.float32), RATE)
            yield out("audio", media_delta=[pieces[0]])
            yield out("audio", media_delta=[pieces[1]], media=[whole], finished=True,
                      final=True, finish_reason="stop")  # fmt: skip


def client_for(engine: ScriptedEngine, **settings: Any) -> TestClient:
    """The app with its state set as its lifespan sets it (no lifespan runs here)."""
    config = ServerConfig(pipeline="tiny-chat", **settings)
    app = build_app(config, engine_client=engine)
    init_app_state(engine, app.state, config)
    return TestClient(app)


def chat(client: TestClient, **body: Any) -> Any:
    reply = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body}
    )
    assert reply.status_code == 200, reply.text
    return reply.json() if not body.get("stream") else events(reply.text)


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def frames(data: str) -> bytes:
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        assert w.getframerate() == RATE
        return w.readframes(w.getnframes())


def test_without_modalities_a_request_asks_for_every_output_in_vllm_omnis_shape():
    engine = ScriptedEngine()
    reply = chat(client_for(engine))
    assert engine.calls[0]["modalities"] == ["text", "image", "audio"]
    text, image, speech = reply["choices"]
    assert [c["index"] for c in reply["choices"]] == [0, 0, 0]
    assert text["message"]["content"] == "hi" and text["finish_reason"] == "stop"
    assert image["message"]["content"][0]["type"] == "image_url"
    assert base64.b64decode(image["message"]["content"][0]["image_url"]["url"].split(",")[1]) == PNG
    assert (
        speech["message"]["content"] is None
        and len(frames(speech["message"]["audio"]["data"])) == 16
    )
    assert reply["usage"]["prompt_tokens"] == 3 and reply["usage"]["completion_tokens"] == 2


def test_default_modalities_flag_and_a_request_in_openais_form():
    engine = ScriptedEngine()
    client = client_for(engine, default_modalities=["text", "audio"])
    (choice,) = chat(client, audio={"voice": "v", "format": "wav"})["choices"]
    assert engine.calls[0]["modalities"] == ["text", "audio"]
    assert choice["message"]["content"] == "hi" and choice["message"]["audio"]["transcript"] == "hi"
    assert len(frames(choice["message"]["audio"]["data"])) == 16


def test_forced_dialects_override_the_form():
    (one,) = chat(client_for(ScriptedEngine(), chat_dialect="openai"))["choices"]
    assert (
        one["message"]["content"] == "hi" and one["message"]["images"] and one["message"]["audio"]
    )
    forced = chat(client_for(ScriptedEngine(), chat_dialect="vllm-omni"), audio={"format": "wav"})
    assert len(forced["choices"]) == 3


def test_vllm_omnis_stream_tags_chunks_and_sends_each_speech_piece_as_a_file():
    chunks = chat(client_for(ScriptedEngine()), stream=True, stream_options={"include_usage": True})
    tags = [c.get("modality") for c in chunks]
    assert tags == ["text", "text", "text", "image", "audio", "audio", None, None]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:3]) == "hi"
    speech = [c for c in chunks if c.get("modality") == "audio"]
    assert [len(frames(c["choices"][0]["delta"]["content"])) for c in speech] == [8, 8]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in speech)
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_openais_stream_sends_speech_as_delta_audio_pieces_of_one_file():
    chunks = chat(client_for(ScriptedEngine()), stream=True, audio={"format": "pcm16"})
    assert all("modality" not in c for c in chunks)
    pieces = [
        c["choices"][0]["delta"]["audio"] for c in chunks if "audio" in c["choices"][0]["delta"]
    ]
    data = b"".join(base64.b64decode(p["data"]) for p in pieces if "data" in p)
    assert pieces[0]["transcript"] == "hi" and len(data) == 16 and "expires_at" in pieces[-1]


@pytest.mark.parametrize(("audio_format", "magic"), [("flac", b"fLaC"), ("opus", b"OggS")])
def test_compressed_formats_are_whole_files_in_both_shapes(audio_format, magic):
    client = client_for(ScriptedEngine())
    reply = chat(client, audio={"format": audio_format})
    assert base64.b64decode(reply["choices"][0]["message"]["audio"]["data"]).startswith(magic)
    streamed = chat(client, stream=True, audio={"format": audio_format})
    pieces = [
        c["choices"][0]["delta"]["audio"] for c in streamed if "audio" in c["choices"][0]["delta"]
    ]
    (data,) = [p["data"] for p in pieces if "data" in p]  # no joinable pieces: sent whole
    assert base64.b64decode(data).startswith(magic)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"audio": {"format": "aac"}}, "audio format"),
        ({"modalities": ["text"], "audio": {"format": "wav"}}, "audio"),
        ({"speaker": "a", "audio": {"voice": "b"}}, "differ"),
        ({"width": 64, "size": "32x32"}, "size"),
        ({"media_io_kwargs": {"video": {"codec": "x"}}}, "media_io_kwargs.video.codec"),
        ({"extra_body": {"seed": 2}, "seed": 1}, "extra_body"),
    ],
)
def test_bad_omni_fields_are_400(body, field):
    client = client_for(ScriptedEngine())
    reply = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body}
    )
    assert reply.status_code == 400 and field in reply.json()["error"]["message"], reply.text


def test_a_diffusion_first_pipeline_draws_the_users_text_once_per_output():
    engine = ScriptedEngine(produces=("image",))
    client = client_for(engine)
    messages = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "a red"},
        {"role": "user", "content": [{"type": "text", "text": "cat"}]},
    ]
    reply = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "extra_body": {"height": 64, "width": 32, "seed": 7,
              "num_outputs_per_prompt": 2, "true_cfg_scale": 4.0}},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert len(choice["message"]["content"]) == 2 and choice["finish_reason"] == "stop"
    assert [c["prompt"] for c in engine.calls] == ["a red cat", "a red cat"]
    assert [c["image_params"]["seed"] for c in engine.calls] == [7, 8]
    assert engine.calls[0]["image_params"] | {"seed": 7} == {
        "width": 32, "height": 64, "true_cfg_scale": 4.0, "seed": 7,
    }  # fmt: skip
    refused = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_batch_answers_one_merged_choice_per_conversation():
    engine = ScriptedEngine(produces=("text", "audio"))
    client = client_for(engine)
    conversations = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    reply = client.post(
        "/v1/chat/completions/batch", json={"messages": conversations, "max_tokens": 3}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("chatcmpl-batch-") and [c["index"] for c in body["choices"]] == [
        0,
        1,
    ]
    assert all(c["message"]["content"] == "hi" and c["message"]["audio"] for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4
    assert [c["prompt"]["messages"][0]["content"] for c in engine.calls] == ["a", "b"]
    for bad in ({"n": 2}, {"stream": True}, {"stream": "not-a-bool"}, {"messages": []}):
        refused = client.post("/v1/chat/completions/batch", json={"messages": conversations, **bad})
        assert refused.status_code == 400, refused.text
