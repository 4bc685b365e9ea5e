"""An image or video request whose stream ends aborted, without its media, is a 503 (the
stage's sleep, or the abort), never a 200 with nothing in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnistage.engine.outputs import OmniRequestOutput
from omnistage.entrypoints.openai.api_server import build_app, init_app_state
from omnistage.entrypoints.openai.server_config import ServerConfig


class AbortingEngine:
    def __init__(self, asleep: bool) -> None:
        self.asleep = asleep

    def output_modalities(self) -> list[str]:
        return ["image"]

    def is_sleeping(self, stage_id: int | None = None) -> bool:
        return self.asleep

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[OmniRequestOutput]:
        async def outputs() -> AsyncIterator[OmniRequestOutput]:
            yield OmniRequestOutput(
                "r", 0, "image", finished=True, final=True, finish_reason="abort"
            )

        return outputs()


@pytest.mark.parametrize(("asleep", "code"), [(True, "stage_asleep"), (False, "request_aborted")])
def test_an_aborted_picture_or_video_is_a_503(asleep, code):
    engine = AbortingEngine(asleep)
    config = ServerConfig(pipeline="tiny-image")
    app = build_app(config, engine_client=engine)
    init_app_state(engine, app.state, config)
    client = TestClient(app)
    image = client.post("/v1/images/generations", json={"prompt": "a cat"})
    video = client.post("/v1/videos/sync", data={"prompt": "a cat"})
    for reply in (image, video):
        assert reply.status_code == 503 and reply.json()["error"]["code"] == code, reply.text
        assert reply.headers["Retry-After"] == "1"
