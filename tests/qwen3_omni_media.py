"""Media prompts for Qwen3-Omni tests: a deterministic tone and picture made in the test, the
cases, and transformers' own ``Qwen3OmniMoeProcessor`` for the tiny folder as the reference
processor.

``Qwen3OmniMoeProcessor.from_pretrained`` also loads a video processor, which needs
torchvision (not installed here): ``hf_processor`` builds the processor from its parts (the
tokenizer, ``WhisperFeatureExtractor`` and the PIL ``Qwen2VLImageProcessorPil`` read from the
folder) with a stand-in video processor that refuses videos. Audio and images go through
transformers' own code.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any
from unittest import mock

import numpy as np
from PIL import Image

RATE = 16000
# name -> content parts of one user message ("audio" / "image" placeholders, else text) and
# the media: audio as seconds, images as (height, width); image 150 x 260 -> a 10 x 16 patch
# grid, 40 placeholder tokens; audio 2.5 s -> 250 mel frames, 3 chunks, 33 placeholders.
CASES: dict[str, tuple[list[str], list[tuple[str, Any]]]] = {
    "audio": (["audio", "Transcribe."], [("audio", 2.5)]),
    "image": (["Describe", "image", "please."], [("image", (150, 260))]),
    "audio_image": (["audio", "and", "image"], [("audio", 1.3), ("image", (60, 90))]),
}


def tone(seconds: float, seed: int = 0) -> np.ndarray:
    """A 440 Hz tone plus seeded noise, float32 mono at 16 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    noise = 0.05 * np.random.RandomState(seed).randn(len(t))
    return (0.3 * np.sin(2 * np.pi * 440 * t) + noise).astype(np.float32)


def picture(height: int, width: int, seed: int = 0) -> Image.Image:
    """Seeded random RGB pixels."""
    return Image.fromarray(
        np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8)
    )


class NoVideoProcessor:
    """Stands in for the torchvision-only video processor; refuses videos."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    temporal_patch_size = 2
    merge_size = 2

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("video needs torchvision")


@functools.lru_cache(maxsize=4)
def hf_processor(folder: str) -> Any:
    """transformers' ``Qwen3OmniMoeProcessor`` for the folder (see the module docstring)."""
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(folder)  # media tokens: extra_special_tokens
    images = Qwen2VLImageProcessorPil.from_pretrained(folder)
    features = WhisperFeatureExtractor.from_pretrained(folder)
    # the class check looks the video processor up in a torchvision-only table
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class"):
        return Qwen3OmniMoeProcessor(
            image_processor=images,
            video_processor=NoVideoProcessor(),
            feature_extractor=features,
            tokenizer=tokenizer,
        )


def messages(case: str) -> list[dict[str, Any]]:
    """The case as one chat message with typed content parts."""
    parts = CASES[case][0]
    content = [
        {"type": p} if p in ("audio", "image") else {"type": "text", "text": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


def media(case: str) -> dict[str, list[Any]]:
    """The case's media as the processor takes them (``audio`` / ``images`` lists)."""
    out: dict[str, list[Any]] = {"audio": [], "images": []}
    for k, (kind, spec) in enumerate(CASES[case][1]):
        if kind == "audio":
            out["audio"].append(tone(spec, seed=k))
        else:
            out["images"].append(picture(*spec, seed=k))
    return out


def processor_outputs(folder: str, case: str) -> dict[str, Any]:
    """``Qwen3OmniMoeProcessor``'s output for the case (tensors: ``input_ids``,
    ``attention_mask``, ``input_features`` / ``feature_attention_mask`` for audio,
    ``pixel_values`` / ``image_grid_thw`` for images), ready for ``reference_generate``."""
    processor = hf_processor(str(folder))
    text = processor.tokenizer.apply_chat_template(
        messages(case), tokenize=False, add_generation_prompt=True
    )
    call = {k: v for k, v in media(case).items() if v}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = processor(text=text, return_tensors="pt", **call)
    return {k: v for k, v in outputs.items() if k != "num_audio_tokens"}
