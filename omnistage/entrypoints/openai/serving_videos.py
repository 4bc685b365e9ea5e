"""``POST /v1/videos``: text to video in the shape vLLM-Omni serves (its synchronous route).

The body is a multipart (or URL-encoded) form, as vLLM-Omni reads it and as the official
``openai`` client's ``videos.create`` sends it (its ``extra_body`` fields become form fields);
a JSON body is read too. Fields: ``prompt``, ``model``, ``user``, ``size`` (``"WIDTHxHEIGHT"``)
or ``width`` and ``height``, ``num_frames``, ``fps``, ``seconds`` (``num_frames`` = seconds x
fps + 1), ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``seed``,
``response_format`` (``b64_json`` only). The reply is ``{"created", "data": [{"b64_json": the
MP4 in base64, ...}]}``, each video also saying its ``width``, ``height``, ``num_frames``,
``fps`` and ``seed``. Any other field (an ``input_reference`` image, a second guidance
scale ``guidance_scale_2``, ...) is a 400 naming it; so is a size, frame count, frame rate
or step count the stage's family refuses. vLLM-Omni's later asynchronous jobs (``GET
/v1/videos/{id}``) are not served.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile

from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import _RequestBody, parse_size
from omnistage.entrypoints.openai.replies import new_id, now
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.errors import InvalidRequestError
from omnistage.stage.media import OmniVideo

router = APIRouter(tags=["openai"])

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MODALITY = "image"  # what a diffusion stage outputs, its videos included


class VideoGenerationRequest(_RequestBody):
    prompt: str = Field(min_length=1)
    model: str | None = None
    user: str | None = None  # the caller's end-user id: accepted, not used
    size: str | None = None
    width: int | None = Field(default=None, ge=1)
    height: int | None = Field(default=None, ge=1)
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1)
    seconds: int | None = Field(default=None, ge=1)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0)
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0)
    response_format: Literal["b64_json"] = "b64_json"

    @field_validator("size")
    @classmethod
    def _check_size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    def image_params(self) -> dict[str, Any]:
        """The diffusion stage's parameters (``DiffusionParams``)."""
        width, height = parse_size(self.size) if self.size is not None else (None, None)
        if self.size is not None and (self.width, self.height) not in (
            (None, None),
            (width, height),
        ):
            raise InvalidRequestError("size", "disagrees with width and height; give one")
        num_frames = self.num_frames
        if self.seconds is not None:
            if num_frames is not None:
                raise InvalidRequestError("seconds", "give seconds or num_frames, not both")
            if self.fps is None:
                raise InvalidRequestError("seconds", "needs fps (num_frames = seconds x fps + 1)")
            num_frames = self.seconds * self.fps + 1
        params: dict[str, Any] = {
            "video": True,
            "width": width or self.width,
            "height": height or self.height,
            "num_frames": num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
        }
        return {k: v for k, v in params.items() if v is not None}


class VideoData(BaseModel):
    b64_json: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int | None = None
    revised_prompt: str | None = None  # OpenAI's field: never revised here


class VideosResponse(BaseModel):
    created: int
    data: list[VideoData]


async def read_body(request: Request) -> VideoGenerationRequest:
    """The form (or JSON) body as a request; 400 naming the field for a bad one."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    data: Any
    if content_type in FORM_TYPES:
        form = await request.form()
        data = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                raise InvalidRequestError(
                    key, "files are not taken: this route makes text to video"
                )
            if key in data:
                raise InvalidRequestError(key, "given more than once")
            data[key] = value
    else:
        try:
            data = json.loads(await request.body() or b"null")
        except ValueError as exc:
            raise InvalidRequestError("body", f"must be a form or JSON: {exc}") from None
    try:
        return VideoGenerationRequest.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


@router.post("/v1/videos", response_model=VideosResponse)
async def create_video(request: Request, engine: EngineClientDep) -> Any:
    body = await read_body(request)
    check_model(request, body.model)
    if MODALITY not in engine.output_modalities():
        raise InvalidRequestError("model", "this pipeline has no diffusion stage")
    params = body.image_params()
    log = RequestLog(request, new_id("video"), "videos")
    log.received(size=body.size, num_frames=params.get("num_frames"))

    async def video() -> list[OmniVideo]:
        videos: list[OmniVideo] = []
        async for out in engine.generate(
            body.prompt,
            {"seed": body.seed} if body.seed is not None else {},
            [MODALITY],
            image_params=params,
            request_id=log.request_id,
        ):
            videos.extend(m for m in out.media if isinstance(m, OmniVideo))
        return videos

    videos = await unless_disconnected(request, video())
    if videos is None:
        log.finished("disconnect")
        return Response(status_code=499)
    log.finished("stop" if videos else "abort", videos=len(videos))
    return VideosResponse(
        created=now(),
        data=[
            VideoData(
                b64_json=base64.b64encode(v.mp4).decode("ascii"),
                width=v.width,
                height=v.height,
                num_frames=v.num_frames,
                fps=v.fps,
                seed=v.seed,
            )
            for v in videos
        ],
    )
