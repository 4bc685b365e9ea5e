"""``POST /v1/images/generations`` (OpenAI shape plus vLLM-Omni's extra fields)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omnistage.engine.outputs import OmniImage
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import ImageGenerationRequest
from omnistage.entrypoints.openai.replies import ImageData, ImagesResponse, new_id, now
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, ended_without
from omnistage.entrypoints.serve.deps import EngineClientDep

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations", response_model=ImagesResponse)
async def create_images(
    body: ImageGenerationRequest, request: Request, engine: EngineClientDep
) -> Any:
    check_model(request, body.model)
    log = RequestLog(request, new_id("img"), "images")
    log.received(n=body.n, size=body.size)

    async def one(index: int) -> list[OmniImage]:
        seed = None if body.seed is None else body.seed + index
        images: list[OmniImage] = []
        last = None
        async for out in engine.generate(
            body.prompt,
            {"seed": seed} if seed is not None else {},
            ["image"],
            image_params=body.image_params(seed),
            request_id=f"{log.request_id}-{index}",
        ):
            images.extend(out.images)
            last = out
        if not images:  # aborted: an error, never a 200 with nothing in it
            raise ended_without(engine, last, "an image")
        return images

    async def all_images() -> list[list[OmniImage]]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(body.n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed: the others' images would go to nobody
                task.cancel()

    results = await unless_disconnected(request, all_images())
    if results is None:
        log.finished("disconnect")
        return Response(status_code=499)
    images = [img for batch in results for img in batch]
    log.finished("stop" if images else "abort", images=len(images))
    return ImagesResponse(
        created=now(),
        data=[ImageData(b64_json=base64.b64encode(img.png).decode("ascii")) for img in images],
    )
