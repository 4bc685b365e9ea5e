"""``POST /v1/images/generations`` (OpenAI shape plus vLLM-Omni's extra fields)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omnistage.engine.outputs import OmniImage
from omnistage.entrypoints.openai.disconnect import unless_disconnected
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

    async def all_images() -> list[list[OmniImage]]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(body.n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed: the others' images would go to nobody
                task.cancel()

    metrics = request.app.state.metrics
    results = await unless_disconnected(request, all_images())
    if results is None:
        metrics.requests.labels("images", "disconnect").inc()
        return Response(status_code=499)
    images = [img for batch in results for img in batch]
    metrics.requests.labels("images", "stop" if images else "abort").inc()
    return JSONResponse(
        {
            "created": now(),
            "data": [{"b64_json": base64.b64encode(img.png).decode("ascii")} for img in images],
        }
    )
