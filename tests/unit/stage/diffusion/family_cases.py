"""How each real family's tiny preset is compared with diffusers: the pipeline class that
loads its folder, the call that makes the reference, and the same request for our stage."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from omnistage.models.tiny import ensure_preset


def preset_folder(preset: str) -> Path:
    """The preset in the shared model cache (built once per clone, as servers build it)."""
    return ensure_preset(preset, Path(os.environ["OMNISTAGE_CACHE_DIR"]) / preset)


@dataclass(frozen=True)
class FamilyCase:
    pipeline_class: str
    prompt: str
    params: dict[str, Any]  # DiffusionParams fields besides seed and return_pixels
    call: dict[str, Any]  # the diffusers __call__ kwargs that mean the same
    vary: Callable[[int], dict[str, Any]] = lambda i: {}  # batch-mates' own params
    other_prompt: Callable[[int], str] = lambda i: f"other {i}"  # and their prompts
    tolerance: float = 1e-5
    frames: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def load_reference(self, folder: Path) -> Any:
        import diffusers

        with float32_load(folder):
            pipe = getattr(diffusers, self.pipeline_class).from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_pixels(self, pipe: Any, seed: int) -> np.ndarray:
        out = pipe(
            self.prompt,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            **self.call,
        )
        return out.frames[0] if self.frames else out.images[0]


@contextlib.contextmanager
def float32_load(folder: Path) -> Any:
    """diffusers loads a class that keeps modules in float32 (``_keep_in_fp32_modules``: Wan's
    transformer) only with ``accelerate`` installed, whatever the dtype; in float32, as the
    references load, keeping them changes nothing, so the check is off for the load."""
    import diffusers

    index = json.loads((folder / "model_index.json").read_text())
    classes = [
        getattr(diffusers, value[1])
        for value in index.values()
        if isinstance(value, list) and value[0] == "diffusers" and hasattr(diffusers, value[1])
    ]
    with contextlib.ExitStack() as stack:
        for cls in classes:
            if getattr(cls, "_keep_in_fp32_modules", None):
                stack.enter_context(mock.patch.object(cls, "_keep_in_fp32_modules", None))
        yield


CASES: dict[str, FamilyCase] = {
    "tiny-flux": FamilyCase(
        "FluxPipeline",
        "a red cat",
        params={
            "num_inference_steps": 3,
            "height": 32,
            "width": 48,
            "guidance_scale": 3.5,
            "max_sequence_length": 16,
        },
        call={
            "num_inference_steps": 3,
            "height": 32,
            "width": 48,
            "guidance_scale": 3.5,
            "max_sequence_length": 16,
        },
        vary=lambda i: {"guidance_scale": 1.0 + i},
    ),
    "tiny-sd3": FamilyCase(
        "StableDiffusion3Pipeline",
        "a red cat",
        params={
            "num_inference_steps": 3,
            "height": 32,
            "width": 40,
            "guidance_scale": 4.5,
            "negative_prompt": "blurry",
            "max_sequence_length": 16,
        },
        call={
            "num_inference_steps": 3,
            "height": 32,
            "width": 40,
            "guidance_scale": 4.5,
            "negative_prompt": "blurry",
            "max_sequence_length": 16,
        },
        vary=lambda i: {"guidance_scale": 2.0 + i, "negative_prompt": f"bad {i}"},
    ),
    "tiny-qwen-image": FamilyCase(
        "QwenImagePipeline",
        "a red cat",
        params={
            "num_inference_steps": 3,
            "height": 32,
            "width": 48,
            "guidance_scale": 4.0,
            "negative_prompt": "blurry",
        },
        call={
            "num_inference_steps": 3,
            "height": 32,
            "width": 48,
            "true_cfg_scale": 4.0,
            "negative_prompt": "blurry",
        },
        # Same token counts: Qwen-Image's prompts are not padded, so only those batch.
        vary=lambda i: {"guidance_scale": 2.0 + i, "negative_prompt": f"blur {i}"},
        other_prompt=lambda i: f"a red do{i}",
    ),
    "tiny-wan": FamilyCase(
        "WanPipeline",
        "a red cat",
        params={
            "video": True,
            "num_frames": 5,
            "num_inference_steps": 2,
            "height": 32,
            "width": 48,
            "guidance_scale": 5.0,
            "negative_prompt": "blurry",
            "max_sequence_length": 16,
        },
        call={
            "num_frames": 5,
            "num_inference_steps": 2,
            "height": 32,
            "width": 48,
            "guidance_scale": 5.0,
            "negative_prompt": "blurry",
            "max_sequence_length": 16,
        },
        vary=lambda i: {"guidance_scale": 2.0 + i, "negative_prompt": f"bad {i}"},
        frames=True,
    ),
}
