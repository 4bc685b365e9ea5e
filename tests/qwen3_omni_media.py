"""Media prompts for Qwen3-Omni tests: deterministic tones, pictures and video frames made in
the test, the cases, and transformers' own ``Qwen3OmniMoeProcessor`` for the tiny folder as
the reference processor.

``Qwen3OmniMoeProcessor.from_pretrained`` also loads a video processor, which needs
torchvision (not installed here): ``hf_processor`` builds the processor from its parts (the
tokenizer, ``WhisperFeatureExtractor`` and the PIL ``Qwen2VLImageProcessorPil`` read from the
folder) with a stand-in video processor running our ``video_pixels``
(tests/qwen2_5_omni_media.py: ``StandInVideoProcessor``; transformers' ``Qwen2VLVideoProcessor``
takes the frames as given, so only the patching is ours). Audio, images, the placeholder
expansion, the interleaving of a video with its audio track and ``video_second_per_grid`` go
through transformers' own code. Our video pixels are compared with the image processor's in
tests/unit/models/qwen2_5_omni/test_inputs.py (and with torchvision's processor where it loads).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any
from unittest import mock

import numpy as np
from PIL import Image

from omnistage.models.media import Audio, MediaItem, Video
from tests.qwen2_5_omni_media import StandInVideoProcessor

RATE = 16000
SMALL_FRAMES = {"min_pixels": 3136, "max_pixels": 16384}  # 56 x 56 -> 64 x 64: 2 x 2 tokens
# name -> content parts of one user message ("audio" / "image" / "video" placeholders, else
# text), the media and the request's options (mm_processor_kwargs). Audio as seconds, images
# as (height, width), videos as (frames, height, width, fps); a video's audio track lasts
# as long as its frames. image 150 x 260 -> a 10 x 16 patch grid, 40 placeholder tokens;
# audio 2.5 s -> 250 mel frames, 3 chunks, 33 placeholders; video "video": 5 frames -> 3
# temporal patches of 2 x 2 tokens, 26 position ids apart (fps 1 over the video's own 2);
# "video_audio": 8 frames of 56 x 84 -> 4 patches of 2 x 3 tokens, 13 ids apart, with 4 s of
# audio (52 tokens) between them; "video_bounds": the processor's own frame bounds (56 x 56
# scaled up to 384 x 384: 144 tokens).
CASES: dict[str, tuple[list[str], list[tuple[str, Any]], dict[str, Any]]] = {
    "audio": (["audio", "Transcribe."], [("audio", 2.5)], {}),
    "image": (["Describe", "image", "please."], [("image", (150, 260))], {}),
    "audio_image": (["audio", "and", "image"], [("audio", 1.3), ("image", (60, 90))], {}),
    "video": (
        ["video", "What happens?"],
        [("video", (5, 56, 56, 2.0))],
        {**SMALL_FRAMES, "fps": 1.0},
    ),
    "video_audio": (
        ["audio", "video", "Both?"],
        [("audio", 1.3), ("video", (8, 56, 84, 2.0))],
        {**SMALL_FRAMES, "use_audio_in_video": True},
    ),
    "video_bounds": (["video", "And now?"], [("video", (2, 56, 56, 2.0))], {}),
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


def frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Seeded random RGB frames ``[count, height, width, 3]``."""
    return np.random.RandomState(seed).randint(0, 256, (count, height, width, 3), np.uint8)


@functools.lru_cache(maxsize=4)
def hf_processor(folder: str) -> Any:
    """transformers' ``Qwen3OmniMoeProcessor`` for the folder (see the module docstring)."""
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # use_audio_in_video's rename, cap_pixels_per_frame
    tokenizer = AutoTokenizer.from_pretrained(folder)  # media tokens: extra_special_tokens
    images = Qwen2VLImageProcessorPil.from_pretrained(folder)
    features = WhisperFeatureExtractor.from_pretrained(folder)
    # the class check looks the video processor up in a torchvision-only table
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class"):
        return Qwen3OmniMoeProcessor(
            image_processor=images,
            video_processor=StandInVideoProcessor(images),
            feature_extractor=features,
            tokenizer=tokenizer,
        )


def messages(case: str) -> list[dict[str, Any]]:
    """The case as one chat message with typed content parts."""
    parts = CASES[case][0]
    content = [
        {"type": p} if p in ("audio", "image", "video") else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def options(case: str) -> dict[str, Any]:
    """The case's ``mm_processor_kwargs``."""
    return dict(CASES[case][2])


def media(case: str) -> dict[str, list[Any]]:
    """The case's media as the processor takes them (``audio`` / ``images`` / ``videos``
    lists, in prompt order; with ``use_audio_in_video`` each video's track in ``audio`` at
    the video's place) and ``from_video`` (``audio_from_video_indices``)."""
    out: dict[str, list[Any]] = {"audio": [], "images": [], "videos": [], "from_video": []}
    with_audio = options(case).get("use_audio_in_video", False)
    for k, (kind, spec) in enumerate(CASES[case][1]):
        if kind == "audio":
            out["audio"].append(tone(spec, seed=k))
            out["from_video"].append(None)
        elif kind == "image":
            out["images"].append(picture(*spec, seed=k))
        else:
            out["videos"].append(frames(*spec[:3], seed=k))
            if with_audio:
                out["audio"].append(tone(spec[0] / spec[3], seed=k + 10))
                out["from_video"].append(len(out["videos"]) - 1)
    return out


def media_items(case: str) -> list[MediaItem]:
    """The case's media as ``multi_modal_data`` items, in prompt order (a video with its
    audio track)."""
    items = []
    for k, (kind, spec) in enumerate(CASES[case][1]):
        if kind == "audio":
            items.append(MediaItem("audio", Audio(tone(spec, seed=k), RATE), f"{case}-a{k}"))
        elif kind == "image":
            items.append(MediaItem("image", picture(*spec, seed=k), f"{case}-i{k}"))
        else:
            track = Audio(tone(spec[0] / spec[3], seed=k + 10), RATE)
            video = Video(frames(*spec[:3], seed=k), spec[3], track)
            items.append(MediaItem("video", video, f"{case}-v{k}"))
    return items


def video_fps(case: str) -> float | None:
    """The rate the case's videos stand for: its ``fps`` option, else the videos' own."""
    rates = [spec[3] for kind, spec in CASES[case][1] if kind == "video"]
    return options(case).get("fps", rates[0]) if rates else None


def processor_outputs(folder: str, case: str) -> dict[str, Any]:
    """``Qwen3OmniMoeProcessor``'s output for the case (tensors: ``input_ids``,
    ``attention_mask``, ``input_features`` / ``feature_attention_mask`` for audio,
    ``pixel_values`` / ``image_grid_thw`` for images, ``pixel_values_videos`` /
    ``video_grid_thw`` / ``video_second_per_grid`` for videos), ready for
    ``reference_generate`` (with ``use_audio_in_video`` where the case asks for it)."""
    processor = hf_processor(str(folder))
    text = processor.tokenizer.apply_chat_template(
        messages(case), tokenize=False, add_generation_prompt=True
    )
    given = media(case)
    opts = options(case)
    call = {k: v for k, v in given.items() if v and k != "from_video"}
    call |= {k: v for k, v in opts.items() if k.endswith("_pixels")}
    if given["videos"]:
        call["fps"] = video_fps(case)
    if opts.get("use_audio_in_video"):
        call |= {"use_audio_in_video": True, "audio_from_video_indices": given["from_video"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = processor(text=text, return_tensors="pt", **call)
    outputs = {k: v for k, v in outputs.items() if k != "num_audio_tokens"}
    if opts.get("use_audio_in_video"):
        outputs["use_audio_in_video"] = True
    return outputs
