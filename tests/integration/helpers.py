"""Small helpers for driving AsyncOmni in tests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.engine.async_omni import AsyncOmni

GREEDY = {"temperature": 0.0, "max_tokens": 12}
IMAGE = {"seed": 7, "num_inference_steps": 4}


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pngs: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(
    engine: AsyncOmni,
    prompt: str | dict[str, Any],
    modalities: list[str] | None = None,
    sampling: dict[str, Any] | None = None,
    image: dict[str, Any] | None = None,
    request_id: str | None = None,
    started: asyncio.Event | None = None,
) -> Result:
    """Run one request to the end; ``started`` is set when its first output arrives."""
    result = Result()
    async for out in engine.generate(
        prompt,
        sampling if sampling is not None else GREEDY,
        modalities,
        image_params=image or IMAGE,
        request_id=request_id,
    ):
        if started is not None:
            started.set()
        if out.modality == "text":
            result.text += out.text_delta
            result.token_ids.extend(out.new_token_ids)
        result.pngs.extend(img.png for img in out.images)
        if out.final:
            result.finish_reason = out.finish_reason
    return result


async def until(condition: Any, timeout_s: float, what: str) -> float:
    """Wait until ``condition()`` holds (failing after ``timeout_s``); the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s}s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start
