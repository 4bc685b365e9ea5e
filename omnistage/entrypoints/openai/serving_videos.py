"""Text to video as vLLM-Omni and OpenAI's ``videos`` API serve it.

- ``POST /v1/videos``: a job (``video_jobs``), answered at once with its ``id`` and
  ``status`` ``queued``; ``GET /v1/videos`` (``after``, ``limit``, ``order``),
  ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` (the MP4 once ``completed``),
  ``DELETE /v1/videos/{id}`` (cancels an unfinished one). The official ``openai`` client's
  ``videos.create`` / ``retrieve`` / ``list`` / ``download_content`` / ``delete`` /
  ``create_and_poll`` work against them.
- ``POST /v1/videos/sync``: the same request answered with the MP4 itself (headers
  ``X-Request-Id``, ``X-Model``, ``X-Inference-Time-S``, ``X-Num-Frames``, ``X-Fps``,
  ``X-Seed``).

The body is a multipart (or URL-encoded) form, as vLLM-Omni reads it and as ``videos.create``
sends it (its ``extra_body`` fields become form fields); a JSON body is read too. Fields:
``prompt``, ``model``, ``user``, ``size`` (``"WIDTHxHEIGHT"``) or ``width`` and ``height``,
``num_frames`` (rounded to the family's grid, as vLLM-Omni rounds it), ``fps``, ``seconds``
(``num_frames`` = seconds x fps, the family's fps unless given), ``num_inference_steps``,
``guidance_scale``, ``negative_prompt``, ``seed``, ``flow_shift`` (the scheduler's, where it
has one), and vLLM-Omni's ``guidance_scale_2``, ``boundary_ratio``, ``true_cfg_scale`` where
the folder's pipeline takes them (refused naming the pipeline otherwise). Any other field (an
``input_reference`` image: image-to-video is not served) is a 400 naming it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import UploadFile

from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import Size, _RequestBody, parse_size
from omnistage.entrypoints.openai.replies import new_id
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, ended_without
from omnistage.entrypoints.openai.streams import renamed
from omnistage.entrypoints.openai.video_jobs import VideoJob, VideoJobs
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.errors import InvalidRequestError
from omnistage.stage.media import OmniVideo

router = APIRouter(tags=["openai"])

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MODALITY = "image"  # what a diffusion stage outputs, its videos included
PARAMS = "image_params."


class VideoGenerationRequest(_RequestBody):
    prompt: str = Field(min_length=1)
    model: str | None = None
    user: str | None = None  # the caller's end-user id: accepted, not used
    size: Size = None
    width: int | None = Field(default=None, ge=1)
    height: int | None = Field(default=None, ge=1)
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1)
    seconds: int | None = Field(default=None, ge=1)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0)
    flow_shift: float | None = Field(default=None, gt=0, le=100)
    # vLLM-Omni's, for the pipelines that take them (the stage refuses them for others).
    guidance_scale_2: float | None = Field(default=None, ge=0, le=100)
    boundary_ratio: float | None = Field(default=None, ge=0, le=1)
    true_cfg_scale: float | None = Field(default=None, ge=0, le=100)

    def image_params(self) -> dict[str, Any]:
        """The diffusion stage's parameters (``DiffusionParams``)."""
        width, height = parse_size(self.size) if self.size is not None else (None, None)
        if self.size is not None and (self.width, self.height) not in (
            (None, None),
            (width, height),
        ):
            raise InvalidRequestError("size", "disagrees with width and height; give one")
        params = {
            "video": True,
            "width": width or self.width,
            "height": height or self.height,
            **self.model_dump(
                include={
                    "num_frames",
                    "fps",
                    "seconds",
                    "num_inference_steps",
                    "guidance_scale",
                    "negative_prompt",
                    "seed",
                    "flow_shift",
                    "guidance_scale_2",
                    "boundary_ratio",
                    "true_cfg_scale",
                }  # fmt: skip
            ),
        }
        return {k: v for k, v in params.items() if v is not None}


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


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
    if not isinstance(data, dict):
        raise InvalidRequestError("body", "must be a form or a JSON object")
    try:
        return VideoGenerationRequest.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def _body_name(field: str) -> str:
    """A refused parameter named as the body has it."""
    return field.removeprefix(PARAMS)


def _request(body: VideoGenerationRequest) -> tuple[Any, ...]:
    seed = {"seed": body.seed} if body.seed is not None else {}
    return body.prompt, seed, [MODALITY]


def _check(engine: Any, body: VideoGenerationRequest) -> None:
    """Every parameter checked before a job is started (a 400 now, not a failed job)."""
    check = getattr(engine, "check", None)
    if check is None:
        return
    try:
        check(*_request(body), image_params=body.image_params())
    except InvalidRequestError as exc:
        raise type(exc)(_body_name(exc.field), getattr(exc, "reason", str(exc))) from None


async def _make_video(engine: Any, body: VideoGenerationRequest, request_id: str) -> OmniVideo:
    """The request's video (every parameter checked before any stage runs)."""
    stream = engine.generate(
        *_request(body), image_params=body.image_params(), request_id=request_id
    )
    last = None
    async for out in renamed(stream, _body_name):
        last = out
        for media in out.media:
            if isinstance(media, OmniVideo):
                return media
    raise ended_without(engine, last, "a video")


def _jobs(request: Request) -> VideoJobs:
    jobs: VideoJobs = request.app.state.video_jobs
    return jobs


def _checked(request: Request, engine: Any, body: VideoGenerationRequest) -> str:
    model = check_model(request, body.model)
    if MODALITY not in engine.output_modalities():
        raise InvalidRequestError("model", "this pipeline has no diffusion stage")
    return model


@router.post("/v1/videos", response_model=VideoJob, response_model_exclude_none=True)
async def create_video(request: Request, engine: EngineClientDep) -> VideoJob:
    body = await read_body(request)
    model = _checked(request, engine, body)
    _check(engine, body)
    log = RequestLog(request, new_id("video"), "videos")
    log.received(size=body.size, num_frames=body.num_frames, job=True)

    async def run() -> OmniVideo:
        try:
            video = await _make_video(engine, body, log.request_id)
        except Exception as exc:
            log.finished("error", error=str(exc))
            raise
        log.finished("stop", num_frames=video.num_frames)
        return video

    return _jobs(request).start(
        model, body.prompt, run, size=body.size, seconds=str(body.seconds) if body.seconds else None
    )


@router.post("/v1/videos/sync", response_class=Response)
async def create_video_sync(request: Request, engine: EngineClientDep) -> Response:
    body = await read_body(request)
    model = _checked(request, engine, body)
    log = RequestLog(request, new_id("video_sync"), "videos")
    log.received(size=body.size, num_frames=body.num_frames)
    started = time.monotonic()
    video = await unless_disconnected(request, _make_video(engine, body, log.request_id))
    if video is None:
        log.finished("disconnect")
        return Response(status_code=499)
    log.finished("stop", num_frames=video.num_frames)
    headers = {
        "X-Request-Id": log.request_id,
        "X-Model": model,
        "X-Inference-Time-S": f"{time.monotonic() - started:.3f}",
        "X-Num-Frames": str(video.num_frames),
        "X-Fps": str(video.fps),
        "X-Seed": str(video.seed),
    }
    return Response(content=video.mp4, media_type="video/mp4", headers=headers)


@router.get("/v1/videos", response_model=VideoList, response_model_exclude_none=True)
async def list_videos(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=0, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    jobs, has_more = _jobs(request).list(after, limit, order)
    return VideoList(
        data=jobs,
        first_id=jobs[0].id if jobs else None,
        last_id=jobs[-1].id if jobs else None,
        has_more=has_more,
    )


@router.get("/v1/videos/{video_id}", response_model=VideoJob, response_model_exclude_none=True)
async def retrieve_video(video_id: str, request: Request) -> VideoJob:
    return _jobs(request).get(video_id)


@router.get("/v1/videos/{video_id}/content", response_class=FileResponse)
async def download_video(
    video_id: str, request: Request, variant: Literal["video"] = "video"
) -> FileResponse:
    """The MP4 (OpenAI's ``variant`` ``thumbnail`` and ``spritesheet`` are not made)."""
    path = _jobs(request).content(video_id)
    return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted)
async def delete_video(video_id: str, request: Request) -> VideoDeleted:
    await _jobs(request).delete(video_id)
    return VideoDeleted(id=video_id)
