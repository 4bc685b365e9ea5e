"""The tiny Wan 2.1 preset (text to video) against diffusers' ``WanPipeline`` on the same
folder, in the same run, and its per-component sleep and wake.

Throughput: ``concurrency`` requests at once (each its own prompt and seed; 9 frames of 64x64,
4 steps, Wan's default guidance 5.0 with the empty negative prompt, 512 text tokens as the
pipeline pads them). The stage batches them into one denoising loop and encodes each video as
an MP4; diffusers' pipeline object serves one call at a time, so its videos/s at 4 is its
sequential rate (its frames as numpy, no MP4) — ``diffusers_batched_videos_per_s`` is one
call with the 4 prompts as a list. ``same_frames``: the stage's frames for the first prompt
equal diffusers' (max difference under 1e-5).

Sleep/wake rows have the shape of ``diffusion_families``' (``same_png`` compares the frames
after the wake with those before, as float pixels: the MP4's bytes are not bit-stable).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from omnistage.bench.diffusion_families import (
    PROMPTS,
    SIZE,
    STEPS,
    compare_with_diffusers,
    request_params,
    sleep_wake_rows,
)
from omnistage.entrypoints.diffusion import Diffusion
from omnistage.models.tiny import build_preset
from omnistage.stage.diffusion.params import DiffusionParams
from omnistage.stage.diffusion.video import VideoOutput

PRESET = "tiny-wan"
FRAMES, GUIDANCE = 9, 5.0
VIDEO_COLUMNS = [
    "model",
    "concurrency",
    "num_frames",
    "videos_per_s",
    "diffusers_videos_per_s",
    "diffusers_batched_videos_per_s",
    "speedup_vs_diffusers",
    "same_frames",
]


def _params(seed: int, pixels: bool = False) -> DiffusionParams:
    return request_params(seed, pixels, video=True, num_frames=FRAMES, guidance_scale=GUIDANCE)


def load_reference(folder: Path) -> Any:
    """``WanPipeline.from_pretrained`` in float32. diffusers loads a class that keeps modules
    in float32 (the transformer) only with ``accelerate`` installed, whatever the dtype; in
    float32 keeping them changes nothing, so the check is off for the load."""
    import diffusers

    with contextlib.ExitStack() as stack:
        cls = diffusers.WanTransformer3DModel
        stack.enter_context(mock.patch.object(cls, "_keep_in_fp32_modules", None))
        pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference_call(pipe: Any, prompts: list[str], seeds: list[int]) -> Any:
    return pipe(
        prompts,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type="np",
    ).frames


def _throughput(folder: Path, pipe: Diffusion, repeats: int) -> list[dict[str, Any]]:
    reference = load_reference(folder)
    same, timings = compare_with_diffusers(
        pipe, _params, functools.partial(_reference_call, reference), repeats
    )
    return [
        {
            "model": PRESET,
            "concurrency": t.concurrency,
            "num_frames": FRAMES,
            **t.rates("videos"),
            "same_frames": same,
        }
        for t in timings
    ]


def run_video(
    device: str = "cpu", repeats: int = 5
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(throughput rows, sleep/wake rows) of the Wan preset, built into a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-video-") as tmp:
        folder = build_preset(PRESET, Path(tmp) / PRESET)
        with Diffusion(model=folder, device=device, max_batch_size=4) as pipe:
            throughput = _throughput(folder, pipe, repeats)

            def make() -> bytes:
                video = pipe.generate(PROMPTS[0], _params(1, pixels=True))[0]
                assert isinstance(video, VideoOutput) and video.pixels is not None
                return bytes(video.pixels.numpy().tobytes())

            sleep = sleep_wake_rows(PRESET, pipe, repeats, make)
    return throughput, sleep
