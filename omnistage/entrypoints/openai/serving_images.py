"""``POST /v1/images/generations`` (OpenAI shape plus vLLM-Omni's extra fields)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omnistage.engine.outputs import OmniImage
from omnistage.entrypoints.openai.protocol import ImageGenerationRequest, new_id, now

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations")
async def create_images(body: ImageGenerationRequest, request: Request) -> Any:
    engine = request.app.state.engine_client

    async def one(index: int) -> list[OmniImage]:
        seed = None if body.seed is None else body.seed + index
        images: list[OmniImage] = []
        async for out in engine.generate(
            body.prompt,
            {"seed": seed} if seed is not None else {},
            ["image"],
            image_params=body.image_params(seed),
            request_id=new_id("img"),
        ):
            images.extend(out.images)
        return images

    results = await asyncio.gather(*(one(i) for i in range(body.n)))
    images = [img for batch in results for img in batch]
    request.app.state.metrics.requests.labels("images", "stop" if images else "abort").inc()
    return JSONResponse(
        {
            "created": now(),
            "data": [{"b64_json": base64.b64encode(img.png).decode("ascii")} for img in images],
        }
    )
