"""The real image families (tiny presets of FLUX, SD3 and Qwen-Image) against diffusers'
own pipeline on the same folder, in the same run, and their per-component sleep and wake
(Wan's video preset: ``diffusion_video``).

Throughput: ``concurrency`` requests at once, each its own prompt and seed. The stage batches
them into one denoising loop; diffusers' pipeline object serves one call at a time (a server
built on it runs concurrent requests one after another), so its images/s at 4 is its
sequential rate — ``diffusers_batched_images_per_s`` is the same pipeline given the 4 prompts
as one list (one call, one guidance, one size: what only an offline batch can do). Prompts
have equal token counts so that Qwen-Image's unpadded prompts batch too. ``same_image``: the
stage's image for the first prompt equals diffusers' (max pixel difference under 1e-5).

Sleep/wake: each component tag alone, levels 1 and 2 (median of ``repeats``): ``freed_mib``
is the ACK's ``freed_bytes`` (the process's RSS drop on the host, device memory on CUDA;
level 1 on the host keeps the weights in a host backup, so it frees nothing there);
``released_mib`` what the arena unmapped; ``same_png`` the image after the wake equals the
one before it.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.entrypoints.diffusion import Diffusion
from omnistage.models.tiny import build_preset
from omnistage.stage.diffusion.params import DiffusionParams, ImageOutput

MiB = 1024 * 1024
PRESETS = {
    "tiny-flux": ("FluxPipeline", {"guidance_scale": 3.5}),
    "tiny-sd3": ("StableDiffusion3Pipeline", {"guidance_scale": 4.5}),
    "tiny-qwen-image": ("QwenImagePipeline", {"guidance_scale": 4.0}),
}
PROMPTS = ["a red cat", "a tan dog", "a big owl", "a wet fox"]  # equal token counts
SIZE, STEPS = 64, 4
THROUGHPUT_COLUMNS = [
    "model",
    "concurrency",
    "images_per_s",
    "diffusers_images_per_s",
    "diffusers_batched_images_per_s",
    "speedup_vs_diffusers",
    "same_image",
]
SLEEP_COLUMNS = ["model", "tag", "level", "weights_mib", "sleep_ms", "wake_ms", "freed_mib"]
SLEEP_COLUMNS += ["released_mib", "same_png"]


def _reference_call(pipe: Any, class_name: str, prompts: list[str], seeds: list[int]) -> Any:
    guidance = PRESETS_BY_CLASS[class_name]
    kwargs: dict[str, Any] = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS}
    if class_name == "QwenImagePipeline":
        kwargs.update(true_cfg_scale=guidance, negative_prompt=[""] * len(prompts))
    else:
        kwargs["guidance_scale"] = guidance
    if class_name == "FluxPipeline":
        kwargs["max_sequence_length"] = 64  # the family's default: the tiny T5's length
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return pipe(prompts, generator=generators, output_type="np", **kwargs).images


PRESETS_BY_CLASS = {cls: params["guidance_scale"] for cls, params in PRESETS.values()}


def median_s(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def request_params(seed: int, pixels: bool = False, **fields: Any) -> DiffusionParams:
    """``STEPS`` steps at ``SIZE`` x ``SIZE`` with ``seed`` and the other ``fields``."""
    return DiffusionParams(
        num_inference_steps=STEPS,
        height=SIZE,
        width=SIZE,
        seed=seed,
        return_pixels=pixels,
        **fields,
    )


@dataclass(frozen=True)
class Timing:
    """Median seconds for ``concurrency`` prompts: the stage given them at once, diffusers'
    pipeline called once per prompt (``sequential_s``) and once with them as a list."""

    concurrency: int
    ours_s: float
    sequential_s: float
    batched_s: float

    def rates(self, unit: str) -> dict[str, float]:
        """The throughput columns, ``unit`` ("images", "videos") per second."""
        return {
            f"{unit}_per_s": self.concurrency / self.ours_s,
            f"diffusers_{unit}_per_s": self.concurrency / self.sequential_s,
            f"diffusers_batched_{unit}_per_s": self.concurrency / self.batched_s,
            "speedup_vs_diffusers": self.sequential_s / self.ours_s,
        }


def compare_with_diffusers(
    pipe: Diffusion,
    params: Callable[..., DiffusionParams],
    reference: Callable[[list[str], list[int]], Any],
    repeats: int,
) -> tuple[bool, list[Timing]]:
    """Whether the stage's output for the first prompt equals diffusers' (max difference
    under 1e-5), and the timings at concurrency 1 and 4. ``params(seed, pixels=...)`` is a
    request's params; ``reference(prompts, seeds)`` diffusers' output, one per prompt."""
    ours = pipe.generate(PROMPTS[0], params(0, pixels=True))[0].pixels
    theirs = reference(PROMPTS[:1], [0])[0]
    same = ours is not None and bool(np.abs(ours.numpy() - theirs).max() <= 1e-5)
    timings = []
    for concurrency in (1, 4):
        prompts, seeds = PROMPTS[:concurrency], list(range(concurrency))
        requests = [params(s) for s in seeds]
        ours_s = median_s(lambda p=prompts, q=requests: pipe.generate(p, q), repeats)

        def sequential(p: list[str] = prompts, q: list[int] = seeds) -> None:
            for prompt, seed in zip(p, q, strict=True):
                reference([prompt], [seed])

        sequential_s = median_s(sequential, repeats)
        batched_s = median_s(lambda p=prompts, q=seeds: reference(p, q), repeats)
        timings.append(Timing(concurrency, ours_s, sequential_s, batched_s))
    return same, timings


def _throughput(name: str, folder: Path, pipe: Diffusion, repeats: int) -> list[dict[str, Any]]:
    import diffusers

    class_name, fields = PRESETS[name]
    reference = getattr(diffusers, class_name).from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    same, timings = compare_with_diffusers(
        pipe,
        functools.partial(request_params, guidance_scale=fields["guidance_scale"]),
        functools.partial(_reference_call, reference, class_name),
        repeats,
    )
    return [
        {"model": name, "concurrency": t.concurrency, **t.rates("images"), "same_image": same}
        for t in timings
    ]


def sleep_wake_rows(
    name: str, pipe: Diffusion, repeats: int, make: Callable[[], bytes]
) -> list[dict[str, Any]]:
    """Each component tag alone at levels 1 and 2; ``make`` generates the output (PNG or
    MP4 bytes) compared before and after."""
    engine = pipe.engine
    before = make()
    rows = []
    for tag in engine.arena.tags:
        for level in (1, 2):
            sleep_ms, wake_ms, freed = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                ack = engine.sleep(level=level, tags=[tag])
                sleep_ms.append((time.perf_counter() - start) * 1e3)
                freed.append(ack.freed_bytes)
                start = time.perf_counter()
                engine.wake_up(tags=[tag])
                wake_ms.append((time.perf_counter() - start) * 1e3)
            after = make()
            rows.append(
                {
                    "model": name,
                    "tag": tag,
                    "level": level,
                    "weights_mib": engine.arena.reserved_bytes(tag) / MiB,
                    "sleep_ms": statistics.median(sleep_ms),
                    "wake_ms": statistics.median(wake_ms),
                    "freed_mib": statistics.median(freed) / MiB,
                    "released_mib": engine.arena.reserved_bytes(tag) / MiB,
                    "same_png": after == before,
                }
            )
    return rows


def run_families(
    device: str = "cpu", repeats: int = 5
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(throughput rows, sleep/wake rows) for every preset, built into a temporary folder."""
    throughput, sleep = [], []
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-families-") as tmp:
        for name in PRESETS:
            folder = build_preset(name, Path(tmp) / name)
            with Diffusion(model=folder, device=device, max_batch_size=4) as pipe:
                throughput += _throughput(name, folder, pipe, repeats)
                guidance = PRESETS[name][1]["guidance_scale"]

                def make(p: Diffusion = pipe, g: float = guidance) -> bytes:
                    image = p.generate(PROMPTS[0], request_params(1, guidance_scale=g))[0]
                    assert isinstance(image, ImageOutput)
                    return image.png

                sleep += sleep_wake_rows(name, pipe, repeats, make)
    return throughput, sleep
