"""Diffusion stage: images/s at batch 1 and 4, sleep/wake latency and freed bytes per level.

Models are the ``image`` preset (what the tiny pipelines serve) and a ~50 MB variant whose
weights are large enough for sleep/wake figures to mean something; both are built into a
temporary folder. ``freed_mib`` is what the process really gave back (RSS on the host, used
device memory on CUDA; level 1 on the host moves the weights into a host backup, so it frees
nothing there), ``arena_released_mib`` what the arena unmapped. ``same_png`` checks that the
image after wake equals the one before.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omnistage.bench.report import write_results
from omnistage.entrypoints.diffusion import Diffusion
from omnistage.models.tiny_diffusion import IMAGE, TinyDiffusionSpec, build_pipeline
from omnistage.stage.diffusion.params import DiffusionParams, ImageOutput

MiB = 1024 * 1024
LARGE = TinyDiffusionSpec(num_layers=12, num_heads=8, head_dim=32, seed=3)
COLUMNS = [
    "model",
    "weights_mib",
    "case",
    "batch_size",
    "images_per_s",
    "sleep_ms",
    "wake_ms",
    "freed_mib",
    "arena_released_mib",
    "same_png",
]
PROMPTS = ["a red cat", "a blue dog", "a green hill", "a yellow boat"]


def _throughput(pipe: Diffusion, batch_size: int, repeats: int) -> float:
    params = [DiffusionParams(seed=i) for i in range(batch_size)]
    prompts = PROMPTS[:batch_size]
    pipe.generate(prompts, params)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pipe.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return batch_size / statistics.median(times)


def _png(pipe: Diffusion) -> bytes:
    image = pipe.generate(PROMPTS[0], DiffusionParams(seed=0))[0]
    assert isinstance(image, ImageOutput)
    return image.png


def _sleep_wake(pipe: Diffusion, level: int, repeats: int) -> dict[str, Any]:
    reference = _png(pipe)
    sleep_ms, wake_ms, freed, released = [], [], [], []
    for _ in range(repeats):
        resident = pipe.memory_stats()["resident_bytes"]
        start = time.perf_counter()
        ack, *_ = pipe.sleep(level=level)
        sleep_ms.append((time.perf_counter() - start) * 1e3)
        released.append(resident - pipe.memory_stats()["resident_bytes"])
        start = time.perf_counter()
        pipe.wake_up()
        wake_ms.append((time.perf_counter() - start) * 1e3)
        freed.append(ack["freed_bytes"])
    same = _png(pipe) == reference
    return {
        "case": f"sleep level {level}",
        "sleep_ms": statistics.median(sleep_ms),
        "wake_ms": statistics.median(wake_ms),
        "freed_mib": statistics.median(freed) / MiB,
        "arena_released_mib": statistics.median(released) / MiB,
        "same_png": same,
    }


def bench_model(folder: Path, name: str, device: str, repeats: int) -> list[dict[str, Any]]:
    with Diffusion(model=folder, device=device, max_batch_size=4) as pipe:
        weights_mib = pipe.engine.pipeline.weight_bytes / MiB
        rows: list[dict[str, Any]] = [
            {
                "case": "generate",
                "batch_size": size,
                "images_per_s": _throughput(pipe, size, repeats),
            }
            for size in (1, 4)
        ]
        rows += [_sleep_wake(pipe, level, repeats) for level in (1, 2)]
    for row in rows:
        row.update(model=name, weights_mib=weights_mib)
    return rows


def run(out_dir: str, device: str = "cpu", repeats: int = 5) -> str:
    """The PixArt presets' table, then the real families' against diffusers (images, then
    Wan's videos) and their per-component sleep and wake (``bench/diffusion_families.py``,
    ``bench/diffusion_video.py``)."""
    from omnistage.bench.diffusion_families import SLEEP_COLUMNS, THROUGHPUT_COLUMNS, run_families
    from omnistage.bench.diffusion_video import VIDEO_COLUMNS, run_video

    rows = []
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-diffusion-") as tmp:
        for name, spec in (("image", IMAGE), ("image-50mb", LARGE)):
            folder = build_pipeline(Path(tmp) / name, spec)
            rows += bench_model(folder, name, device, repeats)
    suffix = device.replace(":", "")
    tables = [write_results(out_dir, f"diffusion-{suffix}", rows, COLUMNS)]
    throughput, sleep = run_families(device, repeats)
    tables.append(
        write_results(out_dir, f"diffusion-families-{suffix}", throughput, THROUGHPUT_COLUMNS)
    )
    videos, video_sleep = run_video(device, repeats)
    sleep += video_sleep
    tables.append(write_results(out_dir, f"diffusion-video-{suffix}", videos, VIDEO_COLUMNS))
    tables.append(write_results(out_dir, f"diffusion-components-{suffix}", sleep, SLEEP_COLUMNS))
    return "\n\n".join(tables)
