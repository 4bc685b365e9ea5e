"""What a diffusion request asks for, what it gets back, and how its fields are checked.

``DiffusionParams`` holds the per-request knobs; ``DiffusionRequest`` adds the input (a text
prompt, or conditioning embeddings such as a thinker stage's final hidden states);
``ImageOutput`` is one finished image (a finished video is ``video.VideoOutput``). ``validate_request`` checks a request against what the
loaded pipeline can do and raises ``InvalidRequestError`` naming the offending field.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import msgspec
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.media import OmniImage

# Short names accepted for ``DiffusionParams.scheduler`` -> diffusers scheduler class names.
SCHEDULER_NAMES: dict[str, str] = {
    "flow_match_euler": "FlowMatchEulerDiscreteScheduler",
    "ddim": "DDIMScheduler",
}
MAX_INFERENCE_STEPS = 1000
MAX_IMAGE_SIDE = 4096
MAX_EMBEDDING_TOKENS = 4096
MAX_SEED = 2**63 - 1
MAX_FPS = 120
MAX_GUIDANCE_SCALE = 100.0  # the HTTP fields refuse the same; 1e38 made an all-black picture


class DiffusionParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request generation settings.

    ``None`` for ``height``/``width`` means the pipeline's native size (its family's
    ``native_size``, e.g. the denoiser's sample size × the VAE's scale factor); ``seed`` None
    draws one (reported back in ``ImageOutput.seed``). Classifier-free guidance runs when
    ``guidance_scale > 1``, with ``negative_prompt`` (text pipelines) or the request's
    ``negative_prompt_embeds`` as the unconditional input (the family decides what stands in
    when neither exists). ``scheduler`` None uses the pipeline's own scheduler folder;
    "flow_match_euler" or "ddim" override it. ``max_sequence_length`` None uses the family's
    default (diffusers' for the pipeline class, within the tokenizer's limit).
    ``return_pixels`` also returns the decoded float image (H, W, 3) in [0, 1].

    ``video`` asks a video family for a video (``VideoOutput``: an MP4 of ``num_frames``
    frames at ``fps``, or of ``seconds`` x ``fps`` frames; None takes the family's defaults;
    the frames on its grid, ``frames_on_grid``); without it a request makes one image, one
    frame of a video family. ``flow_shift`` sets the scheduler's flow shift for this request
    where the pipeline's scheduler has one (vLLM-Omni's video field).
    """

    num_inference_steps: int = 10
    height: int | None = None
    width: int | None = None
    guidance_scale: float = 1.0
    negative_prompt: str = ""
    seed: int | None = None
    scheduler: str | None = None
    max_sequence_length: int | None = None
    return_pixels: bool = False
    video: bool = False
    num_frames: int | None = None
    fps: int | None = None
    seconds: int | None = None
    flow_shift: float | None = None

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale > 1.0


@dataclass
class DiffusionRequest:
    """One image to generate: either ``prompt`` (text) or ``prompt_embeds`` ([seq, dim])."""

    request_id: str
    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    params: DiffusionParams = field(default_factory=DiffusionParams)
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None  # set when its batch starts


class ImageOutput(msgspec.Struct, tag="image"):
    """A finished image: PNG bytes plus its size and the seed that produced it.

    ``pixels`` (float32, [height, width, 3], values in [0, 1], before PNG quantisation) is set
    only when the request asked for ``return_pixels``.
    """

    png: bytes
    width: int
    height: int
    seed: int
    pixels: torch.Tensor | None = None

    def to_client(self) -> OmniImage:
        return OmniImage(png=self.png, width=self.width, height=self.height, seed=self.seed)


class PipelineLimits(msgspec.Struct, frozen=True):
    """What the loaded pipeline accepts; validation checks requests against it."""

    size_multiple: int  # the family's: e.g. VAE scale factor × denoiser patch size
    embedding_dim: int  # the width of the prompt embeddings the denoiser takes
    has_text_encoder: bool
    native_size: int = 64  # height and width when a request gives none
    max_inference_steps: int = MAX_INFERENCE_STEPS
    max_image_pixels: int = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
    # What the family takes (``DiffusionLimits``); see ``validate_params``.
    takes_prompt_embeds: bool = True
    takes_negative_prompt: bool = True
    takes_scheduler_override: bool = True
    max_sequence_length: int = MAX_EMBEDDING_TOKENS
    max_frames: int = 1
    frame_step: int = 1
    default_frames: int = 1
    default_fps: int = 16
    native_width: int | None = None  # the width when a request gives none, if not native_size
    default_guidance_scale: float = 1.0
    scheduler_options: tuple[str, ...] = ()  # scheduler settings a request may set (flow_shift)
    max_side: int = MAX_IMAGE_SIDE  # the family's longest side (its positions' reach)
    family: str = ""  # the folder's pipeline class (errors name it)
    param_aliases: dict[str, str] = {}  # diffusers' other names for our fields


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidRequestError(name, f"must be in [{low}, {high}], got {value}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(name: str, value: int | None, multiple: int, most: int = MAX_IMAGE_SIDE) -> None:
    if value is None:
        return
    if most < MAX_IMAGE_SIDE and isinstance(value, int) and value > most:
        raise InvalidRequestError(
            name, f"must be at most {most}: this transformer's positions reach {most} pixels a side"
        )
    _check_int(name, value, multiple, MAX_IMAGE_SIDE)
    if value % multiple:
        raise InvalidRequestError(name, f"must be a multiple of {multiple}, got {value}")


def check_embeddings(name: str, embeds: object, dim: int) -> None:
    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequestError(
            name, f"must be a tensor [seq, {dim}], got {type(embeds).__name__}"
        )
    if not embeds.is_floating_point():
        raise InvalidRequestError(name, f"must be a float tensor, got {embeds.dtype}")
    if embeds.ndim != 2:
        raise InvalidRequestError(name, f"must have shape [seq, {dim}], got {list(embeds.shape)}")
    if embeds.shape[1] != dim:
        raise InvalidRequestError(
            name, f"dimension {embeds.shape[1]} does not match the transformer's {dim}"
        )
    if not 1 <= embeds.shape[0] <= MAX_EMBEDDING_TOKENS:
        raise InvalidRequestError(
            name, f"must have 1..{MAX_EMBEDDING_TOKENS} tokens, got {embeds.shape[0]}"
        )
    if not bool(torch.isfinite(embeds).all()):
        raise InvalidRequestError(name, "contains NaN or infinite values")


def validate_params(params: DiffusionParams, limits: PipelineLimits) -> None:
    """Raise ``InvalidRequestError`` naming the first invalid field of ``params``."""
    if not isinstance(params, DiffusionParams):
        raise InvalidRequestError("params", f"must be DiffusionParams, got {type(params).__name__}")
    steps = params.num_inference_steps
    if _is_count(steps) and steps > limits.max_inference_steps:
        raise InvalidRequestError(
            "num_inference_steps",
            f"must be at most {limits.max_inference_steps} (--max-inference-steps, or the "
            f"scheduler's own steps), got {steps}",
        )
    _check_int("num_inference_steps", steps, 1, limits.max_inference_steps)
    _check_size("height", params.height, limits.size_multiple, limits.max_side)
    _check_size("width", params.width, limits.size_multiple, limits.max_side)
    height = params.height or limits.native_size
    width = params.width or limits.native_width or limits.native_size
    if height * width > limits.max_image_pixels:
        raise InvalidRequestError(
            "size",
            f"{width}x{height} is {width * height} pixels; this stage allows at most "
            f"{limits.max_image_pixels} (--max-image-pixels)",
        )
    scale = params.guidance_scale
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise InvalidRequestError("guidance_scale", f"must be a finite number, got {scale!r}")
    if not 0 <= scale <= MAX_GUIDANCE_SCALE:
        raise InvalidRequestError(
            "guidance_scale", f"must be in [0, {MAX_GUIDANCE_SCALE:g}], got {scale}"
        )
    if not isinstance(params.negative_prompt, str):
        raise InvalidRequestError("negative_prompt", "must be a string")
    if params.negative_prompt and not limits.takes_negative_prompt:
        raise InvalidRequestError(
            "negative_prompt", "this pipeline takes no negative prompt (its guidance is distilled)"
        )
    if params.negative_prompt and params.uses_guidance and not limits.has_text_encoder:
        raise InvalidRequestError(
            "negative_prompt",
            "this pipeline has no text encoder; pass negative_prompt_embeds instead",
        )
    if params.seed is not None:
        _check_int("seed", params.seed, 0, MAX_SEED)
    if params.scheduler is not None and not limits.takes_scheduler_override:
        raise InvalidRequestError("scheduler", "this pipeline runs its own scheduler only")
    if params.scheduler is not None and params.scheduler not in SCHEDULER_NAMES:
        raise InvalidRequestError(
            "scheduler",
            f"must be one of {sorted(SCHEDULER_NAMES)} or None, got {params.scheduler!r}",
        )
    if params.max_sequence_length is not None:
        _check_int("max_sequence_length", params.max_sequence_length, 1, limits.max_sequence_length)
    _check_frames(params, limits)


def _check_frames(params: DiffusionParams, limits: PipelineLimits) -> None:
    if not isinstance(params.video, bool):
        raise InvalidRequestError("video", f"must be true or false, got {params.video!r}")
    if params.video and limits.max_frames <= 1:
        raise InvalidRequestError("model", "this pipeline makes images, not videos")
    if params.num_frames is not None:
        if not params.video and params.num_frames != 1:
            raise InvalidRequestError(
                "num_frames", "an image is one frame; ask for a video for more (video: true)"
            )
        _check_int("num_frames", params.num_frames, 1, limits.max_frames)
        _check_int("num_frames", frames_on_grid(params.num_frames, limits), 1, limits.max_frames)
    if params.fps is not None:
        if not params.video:
            raise InvalidRequestError("fps", "only a video has a frame rate")
        _check_int("fps", params.fps, 1, MAX_FPS)
    if params.seconds is not None:
        if not params.video:
            raise InvalidRequestError("seconds", "only a video has a length")
        if params.num_frames is not None:
            raise InvalidRequestError("seconds", "give seconds or num_frames, not both")
        _check_int("seconds", params.seconds, 1, limits.max_frames)
        _check_int("seconds", video_frames(params, limits), 1, limits.max_frames)
    if params.flow_shift is not None:
        if "flow_shift" not in limits.scheduler_options:
            raise InvalidRequestError(
                "flow_shift", f"{limits.family or 'this pipeline'}'s scheduler has no flow shift"
            )
        shift = params.flow_shift
        ok = isinstance(shift, int | float) and not isinstance(shift, bool)
        if not ok or not math.isfinite(shift) or not 0 < shift <= 100:
            raise InvalidRequestError("flow_shift", f"must be in (0, 100], got {shift!r}")


def frames_on_grid(num_frames: int, limits: PipelineLimits) -> int:
    """``num_frames`` on the family's grid, 1 + a multiple of its temporal compression, as
    vLLM-Omni (and diffusers' video pipelines) round it: 8 -> 9, 80 -> 81, 81 -> 81."""
    step = limits.frame_step
    return num_frames if (num_frames - 1) % step == 0 else num_frames // step * step + 1


def video_frames(params: DiffusionParams, limits: PipelineLimits) -> int:
    """A video's frames on the family's grid: ``num_frames``, or ``seconds`` x the frame rate
    (vLLM-Omni's rule: 4 s at 16 fps, 64 frames, are 65), or the family's default."""
    fps = params.fps or limits.default_fps
    frames = params.num_frames or (params.seconds or 0) * fps or limits.default_frames
    return frames_on_grid(frames, limits)


def resolve_params(params: DiffusionParams, limits: PipelineLimits) -> DiffusionParams:
    """A video request's frames (on the family's grid) and frame rate, the family's defaults
    where it gives none."""
    if not params.video:
        return params
    return msgspec.structs.replace(
        params,
        num_frames=video_frames(params, limits),
        fps=params.fps or limits.default_fps,
        seconds=None,
    )


def validate_request(request: DiffusionRequest, limits: PipelineLimits) -> None:
    """Raise ``InvalidRequestError`` naming the first invalid field of ``request``."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    validate_params(request.params, limits)
    has_prompt = request.prompt is not None
    if has_prompt == (request.prompt_embeds is not None):
        raise InvalidRequestError("prompt", "give exactly one of prompt or prompt_embeds")
    if has_prompt:
        if not isinstance(request.prompt, str):
            raise InvalidRequestError(
                "prompt", f"must be a string, got {type(request.prompt).__name__}"
            )
        if not limits.has_text_encoder:
            raise InvalidRequestError(
                "prompt",
                "this pipeline has no text encoder; pass prompt_embeds "
                f"[seq, {limits.embedding_dim}] instead",
            )
    else:
        check_prompt_embeds("prompt_embeds", request.prompt_embeds, limits)
    if request.negative_prompt_embeds is not None:
        check_prompt_embeds("negative_prompt_embeds", request.negative_prompt_embeds, limits)


def check_prompt_embeds(name: str, embeds: object, limits: PipelineLimits) -> None:
    """Embeddings for a pipeline that takes them (``check_embeddings``); the others need a
    text prompt (their denoiser also wants what only its own encoders give, e.g. pooled
    embeddings)."""
    if not limits.takes_prompt_embeds:
        raise InvalidRequestError(name, "this pipeline takes text prompts only")
    check_embeddings(name, embeds, limits.embedding_dim)
