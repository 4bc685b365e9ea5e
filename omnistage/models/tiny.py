"""Built-in tiny checkpoints: random-initialised, seeded, saved in standard layouts.

No model hub is reachable, so built-in pipelines build their models here on first use and
load them through the same loader as a real checkpoint. Same preset → same bytes.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

# preset name -> "module:function"; builders take the output folder and return it.
PRESETS: dict[str, str] = {
    "demo": "omnistage.models.tiny_ar:build_demo",
    "bench": "omnistage.models.tiny_ar:build_bench",
    "image": "omnistage.models.tiny_diffusion:build_image",
    "image-cond": "omnistage.models.tiny_diffusion:build_image_cond",
    "tiny-qwen2.5-omni": "omnistage.models.qwen2_5_omni.tiny:build",
    "tiny-qwen2.5-omni-alt": "omnistage.models.qwen2_5_omni.tiny:build_alt",
}

_DONE_MARKER = ".omnistage-built"


def build_preset(preset: str, out: str | Path) -> Path:
    """Build ``preset`` into ``out`` (a folder). Raises ``ValueError`` for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    module_name, func_name = PRESETS[preset].split(":")
    builder = getattr(importlib.import_module(module_name), func_name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    builder(out)
    (out / _DONE_MARKER).write_text(preset + "\n")
    return out


def is_built(out: str | Path) -> bool:
    return (Path(out) / _DONE_MARKER).exists()


def ensure_preset(preset: str, out: str | Path) -> Path:
    """Build ``preset`` into ``out`` unless a completed build is already there.

    Builds go to a temporary sibling folder first and are renamed into place, so a crash
    or a concurrent build never leaves a half-written model behind.
    """
    out = Path(out)
    if is_built(out):
        return out
    if out.exists() and any(out.iterdir()):
        # Never delete what we did not build: builds land by rename, so a non-empty folder
        # without the marker is somebody else's.
        raise ValueError(
            f"{out} exists and was not built by omnistage; point `model` elsewhere or drop `preset`"
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_preset(preset, tmp)
    if out.exists():
        out.rmdir()  # empty (checked above)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
        if not is_built(out):
            raise
    return out
