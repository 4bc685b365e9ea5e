"""Built-in tiny checkpoints: random-initialised, seeded, saved in standard layouts.

No model hub is reachable, so built-in pipelines build their models here on first use and
load them through the same loader as a real checkpoint. Same preset → same bytes.
"""

from __future__ import annotations

import contextlib
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
    "tiny-flux": "omnistage.models.diffusion.tiny_families:build_flux",
    "tiny-sd3": "omnistage.models.diffusion.tiny_families:build_sd3",
    "tiny-qwen-image": "omnistage.models.diffusion.tiny_families:build_qwen_image",
    "tiny-wan": "omnistage.models.diffusion.tiny_families:build_wan",
    "tiny-qwen2.5-omni": "omnistage.models.qwen2_5_omni.tiny:build",
    "tiny-qwen2.5-omni-alt": "omnistage.models.qwen2_5_omni.tiny:build_alt",
    "tiny-qwen3-omni": "omnistage.models.qwen3_omni.tiny:build",
    "bench-qwen2.5-omni": "omnistage.models.qwen2_5_omni.tiny:build_bench",
    "tiny-qwen3-tts-customvoice": "omnistage.models.qwen3_tts.tiny:build_custom_voice",
    "tiny-qwen3-tts-voicedesign": "omnistage.models.qwen3_tts.tiny:build_voice_design",
    "bench-qwen3-tts-customvoice": "omnistage.models.qwen3_tts.tiny:build_bench",
    "tiny-qwen3-tts-base": "omnistage.models.qwen3_tts.tiny:build_base",
}

_DONE_MARKER = ".omnistage-built"
# Raised whenever a builder writes other files or other bytes: a build whose marker names an
# older version is rebuilt (it is omnistage's own, so it is replaced, never edited).
BUILD_VERSION = 5  # 2: Qwen2.5-Omni's preprocessor config and the chat template with media;
# 3: the tiny Qwen3-Omni's code2wav speaks 240 samples per frame; 4: the tiny Qwen3-TTS
# CustomVoice has the published checkpoint's speakers and languages; 5: every Qwen3-TTS speech
# tokenizer has its preprocessor_config.json (the qwen-tts package loads the folder)


def _marker(preset: str) -> str:
    return f"{preset} v{BUILD_VERSION}\n"


def build_preset(preset: str, out: str | Path) -> Path:
    """Build ``preset`` into ``out`` (a folder). Raises ``ValueError`` for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    module_name, func_name = PRESETS[preset].split(":")
    builder = getattr(importlib.import_module(module_name), func_name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    builder(out)
    (out / _DONE_MARKER).write_text(_marker(preset))
    return out


def is_built(out: str | Path, preset: str | None = None) -> bool:
    """Whether ``out`` holds a finished build (of ``preset`` by this version's builders, when
    ``preset`` is given)."""
    marker = Path(out) / _DONE_MARKER
    if preset is None:
        return marker.exists()
    try:
        return marker.read_text() == _marker(preset)
    except OSError:
        return False


def ensure_preset(preset: str, out: str | Path) -> Path:
    """Build ``preset`` into ``out`` unless a completed build is already there.

    Builds go to a temporary sibling folder first and are renamed into place, so a crash
    or a concurrent build never leaves a half-written model behind.
    """
    out = Path(out)
    if is_built(out, preset):
        return out
    stale = is_built(out)  # an older build of ours: replaced below
    if out.exists() and any(out.iterdir()) and not stale:
        # Never delete what we did not build: builds land by rename, so a non-empty folder
        # without the marker is somebody else's.
        raise ValueError(
            f"{out} exists and was not built by omnistage; point `model` elsewhere or drop `preset`"
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_preset(preset, tmp)
    if stale:  # moved aside, then removed: the folder is never half old, half new
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        with contextlib.suppress(OSError):  # another process replaced it first
            out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    elif out.exists():
        out.rmdir()  # empty (checked above)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
        if not is_built(out, preset):
            raise
    return out
