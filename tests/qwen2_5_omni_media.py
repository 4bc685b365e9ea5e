"""Media prompts for Qwen2.5-Omni tests: inputs made in the test (audio tones, random pictures
and frames), the cases the acceptance tests run, and transformers' own ``Qwen2_5OmniProcessor``
for the tiny folder as the reference processor.

transformers' video processor needs torchvision, which is not installed here: the reference
processor then gets a stand-in video processor running our ``video_pixels`` (its own
placeholder expansion and audio interleaving are still transformers'); see
tests/unit/models/qwen2_5_omni/test_inputs.py for how our video pixels are checked.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import warnings
from unittest import mock

import numpy as np
import torch
from PIL import Image

from omnistage.models.media import Audio, MediaItem, Video
from omnistage.models.omni_inputs import video_pixels

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
SPECIAL = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


class StandInVideoProcessor:
    """``Qwen2VLVideoProcessor``'s interface over ``video_pixels`` (no torchvision), for the
    Qwen2.5-Omni and Qwen3-Omni references: the image processor's patch sizes and
    normalisation, the frame bounds of ``size`` unless ``min_pixels`` / ``max_pixels`` say
    otherwise (as its ``_standardize_kwargs``); frames taken as given (its
    ``do_sample_frames`` is off), so ``fps`` and the rest are not read."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, image_processor):
        self.ip = image_processor
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.merge_size = image_processor.merge_size

    def __call__(self, videos, size=None, min_pixels=None, max_pixels=None, **kwargs):
        from transformers import BatchFeature
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.ip
        low, high = min_pixels or size["shortest_edge"], max_pixels or size["longest_edge"]
        pixels, grids = [], []
        for frames in videos:
            target = smart_resize(*frames.shape[1:3], ip.patch_size * ip.merge_size, low, high)
            p, grid = video_pixels(frames, tuple(target), ip)
            pixels.append(p)
            grids.append(grid)
        return BatchFeature(
            {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
        )


def noise_audio(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    return (tone + 0.05 * np.random.RandomState(seed).randn(len(t))).astype(np.float32)


def picture(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(
        np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8)
    )


def frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (count, height, width, 3), np.uint8)


# name -> (content parts, media, options); video frames are 252 x 420 (a multiple of 28 within
# the processor's video bounds: not resized) or 260 x 350 (resized), audio at 16 kHz.
CASES = {
    "audio": (["audio", "Transcribe."], [("audio", 2.7)], {}),
    "image_text": (["Describe", "image", "please."], [("image", (150, 260))], {}),
    "audio_image": (
        ["audio", "and", "image", "image"],
        [("audio", 1.3), ("image", (60, 90)), ("image", (300, 180))],
        {"max_pixels": 40000},
    ),
    "video": (["video", "What happens?"], [("video", (5, 260, 350, 2.0))], {}),
    "video_audio": (
        ["audio", "video", "Both?"],
        [("audio", 0.9), ("video", (9, 252, 420, 1.5))],
        {"use_audio_in_video": True},
    ),
}


def build(case: str):
    parts, specs, options = CASES[case]
    media, hf_kwargs = [], {"images": [], "videos": [], "audio": [], "from_video": []}
    for k, (modality, spec) in enumerate(specs):
        if modality == "audio":
            samples = noise_audio(spec, seed=k)
            media.append(MediaItem("audio", Audio(samples, 16000), f"a{k}"))
            hf_kwargs["audio"].append(samples)
            hf_kwargs["from_video"].append(None)
        elif modality == "image":
            image = picture(*spec, seed=k)
            media.append(MediaItem("image", image, f"i{k}"))
            hf_kwargs["images"].append(image)
        else:
            count, h, w, fps = spec
            video = frames(count, h, w, seed=k)
            track = noise_audio(count / fps, seed=k + 10)
            media.append(MediaItem("video", Video(video, fps, Audio(track, 16000)), f"v{k}"))
            hf_kwargs["videos"].append(video)
            if options.get("use_audio_in_video"):
                hf_kwargs["audio"].append(track)
                hf_kwargs["from_video"].append(len(hf_kwargs["videos"]) - 1)
            hf_kwargs["fps"] = fps
    content = [
        {"type": p} if p in ("audio", "image", "video") else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}], media, options, hf_kwargs


def hf_process(hf, messages, options, kw):
    text = hf.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    call = {"return_tensors": "pt"}
    for name in ("images", "videos", "audio"):
        if kw[name]:
            call[name] = kw[name]
    if "fps" in kw:
        call["fps"] = kw["fps"]
    if options.get("use_audio_in_video"):
        call["use_audio_in_video"] = True
        call["audio_from_video_indices"] = kw["from_video"]
    call.update({k: v for k, v in options.items() if k.endswith("_pixels")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return text, hf(text=text, **call)


def hf_processor(folder):
    """transformers' processor for the folder (PIL image processor; see the docstring)."""
    from transformers import AutoTokenizer, Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=SPECIAL)
    images = Qwen2VLImageProcessorPil.from_pretrained(folder)
    features = WhisperFeatureExtractor.from_pretrained(folder)
    if HAS_TORCHVISION:
        from transformers import Qwen2VLVideoProcessor

        videos, patch = Qwen2VLVideoProcessor.from_pretrained(folder), contextlib.nullcontext()
    else:  # the class check looks the video processor up in a torchvision-only table
        videos = StandInVideoProcessor(images)
        patch = mock.patch.object(ProcessorMixin, "check_argument_for_proper_class")
    with patch:
        return Qwen2_5OmniProcessor(
            image_processor=images, video_processor=videos, feature_extractor=features,
            tokenizer=tokenizer,
        )  # fmt: skip


def wav_data(samples, rate: int = 16000) -> str:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="FLOAT")  # lossless
    return base64.b64encode(out.getvalue()).decode()


def png_url(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def openai_parts(case: str):
    """The case's messages as the openai client sends them, its media inline."""
    messages, media, options, kw = build(case)
    items = iter(media)
    parts = []
    for part in messages[0]["content"]:
        if part["type"] == "text":
            parts.append(part)
        elif part["type"] == "audio":
            audio = next(items).value
            parts.append(
                {
                    "type": "input_audio",
                    "input_audio": {"data": wav_data(audio.samples), "format": "wav"},
                }
            )
        else:
            parts.append({"type": "image_url", "image_url": {"url": png_url(next(items).value)}})
    return [{"role": "user", "content": parts}], messages, options, kw


def audio_tokens_and_bound(processor, rate: int, seconds: float) -> tuple[int, int]:
    """(the audio placeholders ``processor`` expands a noise clip to, its ``min_tokens``): the
    bound that refuses an audio too long for the context before it is featurized."""
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, int(rate * seconds)).astype(np.float32)
    item = MediaItem("audio", Audio(samples, rate))
    token = processor.placeholder_ids["audio"]
    prompt = [1, processor.audio_bos, token, processor.audio_eos, 2]
    expanded = processor.process(prompt, [item], {})
    count = sum(t == processor.settings.audio_token_id for t in expanded.token_ids)
    return count, processor.min_tokens([item])
