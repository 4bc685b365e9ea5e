"""Media in ``bench omni``: audio-in requests, the encoders' cost and the encoder cache's hits,
on the same ``tiny-qwen2.5-omni`` folder (see ``omnistage.bench.omni`` for how the runs are
timed, and docs/benchmarks.md for how to read the tables).

Audio in, speech out: each request is a clip made here (``audio_s`` of a 440 Hz tone plus
noise at 16 kHz, a different seed per request) before a text part (the text benchmark's
prompts), answered with text and audio. omnistage gets the clip as a ``MediaItem`` whose
content hash is fresh in every pass (warm-up, each concurrency), so neither the encoder cache
nor the prefix cache serves a clip again; transformers gets what its own
``Qwen2_5OmniProcessor`` makes of the same clip and text (the processor call is inside its
timed request, as omnistage's processor is inside its: both go from raw samples to speech).
The processor is built without a video processor (transformers' needs torchvision): audio
and images only.

Encoders: ``encoders["audio"]`` / ``encoders["image"]`` of the thinker decoder built here as a
stage builds it (the family's ``build_decoder`` on meta, adopted into an ``Arena``, loaded),
one torch thread as a stage has, fed the family's prompt processor's item data; median over
``encoder_repeats`` calls after one warm-up (``processor_ms``: that processor, median of two
after one, with the process's threads as in the API process). Baseline: transformers' thinker
``get_audio_features`` / ``get_image_features`` on the same data, same thread count.

Encoder cache: text-only requests of ``cache_tokens`` tokens (1: the thinker's prefill alone,
where the encoder runs) with one medium behind a text no other request has (the prefix cache
cannot serve the medium's blocks): a miss carries a content hash never sent before; a hit one
sent once just before (by another untimed request with other text). Medians over
``cache_repeats`` pairs (the miss first in every other pair), end to end through ``Omni`` (the processor included: it runs before
the cache is looked up).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.bench.report import write_results
from omnistage.models.media import Audio, MediaItem

RATE = 16000  # Whisper features' sampling rate: no resampling on either side
# fmt: off
THROUGHPUT_COLUMNS = ["engine", "concurrency", "requests", "audio_s", "seconds", "requests_per_s",
                      "rtf", "speedup_vs_transformers", "thinker_ms", "talker_ms", "code2wav_ms",
                      "processor_ms", "same_thinker_ids", "same_codes"]
ENCODER_COLUMNS = ["medium", "tokens", "processor_ms", "encoder_ms", "encoder_ms_per_audio_s",
                   "transformers_ms", "speedup_vs_transformers", "same_as_transformers"]
CACHE_COLUMNS = ["medium", "requests", "miss_ms", "hit_ms", "hit_speedup", "encoder_queries",
                 "encoder_hits"]
# fmt: on


@dataclass
class MediaSettings:
    """Clip lengths in seconds, image sizes as (height, width)."""

    audio_s: float = 2.0  # each audio-in request's clip
    encoder_audio_s: tuple[float, ...] = (1.0, 2.0, 8.0, 30.0)
    encoder_images: tuple[tuple[int, int], ...] = ((56, 56), (112, 112), (224, 224))
    encoder_repeats: int = 10
    cache_image: tuple[int, int] = (224, 224)  # the tiny folder's max_pixels: 224 x 224
    cache_repeats: int = 8
    cache_tokens: int = 1  # each cache request's thinker tokens: 1 = its prefill alone

    def __post_init__(self) -> None:
        if (
            min(self.encoder_repeats, self.cache_repeats, self.cache_tokens) < 1
            or self.audio_s < 0.1
        ):
            raise ValueError(f"need repeats >= 1 and clips of 0.1 s or more: {self}")


@contextmanager
def quiet() -> Iterator[None]:
    """No warnings about the tiny config's special ids or greedy flags, no progress bars."""
    from transformers.utils import logging as hf_logging

    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()


@contextmanager
def patched(obj: Any, name: str, wrapper: Any) -> Iterator[None]:
    """``obj.name`` is ``wrapper`` inside (this and ``quiet`` serve ``omni``'s runs too)."""
    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        delattr(obj, name)  # the class attribute shows through again


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def clip(seconds: float, seed: int) -> np.ndarray:
    """A 440 Hz tone plus noise, float32 mono at 16 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    noise = 0.05 * np.random.RandomState(seed).randn(len(t))
    return (0.3 * np.sin(2 * np.pi * 440 * t) + noise).astype(np.float32)


def picture(height: int, width: int, seed: int) -> Any:
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8)
    return Image.fromarray(pixels)


def _content(*parts: str) -> list[dict[str, str]]:
    """Chat content parts: ``audio`` / ``image`` a medium's place, anything else text."""
    return [{"type": p} if p in ("audio", "image") else {"type": "text", "text": p} for p in parts]


def hf_processor(folder: str | Path) -> Any:
    """transformers' ``Qwen2_5OmniProcessor`` for the folder, without a video processor."""
    from transformers import AutoTokenizer, Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class AudioImageProcessor(Qwen2_5OmniProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(name, argument)

    special = {f"{m}_token": f"<|{m.upper()}|>" for m in ("audio", "image", "video")} | {
        f"{m}_{e}_token": f"<|{m}_{e}|>" for m in ("audio", "vision") for e in ("bos", "eos")
    }
    with quiet():
        return AudioImageProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
            video_processor=None,
            feature_extractor=WhisperFeatureExtractor.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder, extra_special_tokens=special),
        )


class AudioRequests:
    """The audio-in requests, by name (``audio <k>``): clip ``k`` and the ``k``-th text."""

    def __init__(self, folder: str | Path, texts: tuple[str, ...], settings: MediaSettings):
        self.folder = folder
        self.names = tuple(f"audio {k}" for k in range(len(texts)))
        self.texts = dict(zip(self.names, texts, strict=True))
        self.clips = {name: clip(settings.audio_s, seed=k) for k, name in enumerate(self.names)}
        self._hf: Any = None

    def messages(self, name: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": _content("audio", self.texts[name])}]

    def omnistage(self, tag: str) -> Callable[[str], dict[str, Any]]:
        """``name`` -> the request for ``Omni.generate``, its clip's content hash fresh to
        ``tag`` (no cache has seen it under another tag)."""

        def request(name: str) -> dict[str, Any]:
            item = MediaItem("audio", Audio(self.clips[name], RATE), f"bench {name} {tag}")
            return {"messages": self.messages(name), "multi_modal_data": [item]}

        return request

    def transformers(self, name: str) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and ``generate``'s other inputs from transformers' processor."""
        if self._hf is None:
            self._hf = hf_processor(self.folder)
        hf = self._hf
        text = hf.tokenizer.apply_chat_template(
            self.messages(name), tokenize=False, add_generation_prompt=True
        )
        out = hf(text=text, audio=[self.clips[name]], return_tensors="pt")
        ids = out.pop("input_ids")
        out["attention_mask"] = torch.ones_like(ids)  # without it: no multimodal positions
        return ids[0].tolist(), dict(out)


def speech_rate(requests: int, audio_s: float, seconds: float) -> dict[str, Any]:
    """The columns every speech throughput table has: ``requests`` that gave ``audio_s`` of
    audio in ``seconds``, their rate and real-time factor."""
    return {
        "requests": requests,
        "audio_s": audio_s,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "rtf": seconds / audio_s if audio_s else None,
    }


def greedy_speech(
    model: Any, input_ids: torch.Tensor, voice: str, settings: Any, **more: Any
) -> Any:
    """transformers' ``generate`` of an omni model, greedy (thinker and talker) in ``voice``,
    with the ``settings``' thinker and talker token counts: its (sequences, waveform)."""
    return model.generate(
        input_ids,
        speaker=voice,
        thinker_do_sample=False,
        talker_do_sample=False,
        thinker_max_new_tokens=settings.thinker_tokens,
        talker_max_new_tokens=settings.talker_tokens,
        **more,
    )


def throughput_rows(
    row: Callable[[str, int, Any, float], dict[str, Any]], baseline: Any, runs: dict[int, Any]
) -> list[dict[str, Any]]:
    """The text table's rows (``row``: ``omni.throughput_row``) for the audio-in passes, with
    how many of omnistage's requests gave transformers' thinker ids and speech codes."""
    rows = [row("transformers", 1, baseline, baseline.seconds)]
    for concurrency, run in runs.items():
        pairs = list(zip(baseline.speech, run.speech, strict=True))
        rows.append(row("omnistage", concurrency, run, baseline.seconds))
        for key, field in (("same_thinker_ids", "thinker_ids"), ("same_codes", "codes")):
            same = sum(
                a.prompt == b.prompt and getattr(a, field) == getattr(b, field) for a, b in pairs
            )
            rows[-1][key] = f"{same}/{len(pairs)}"
    return rows


def write_tables(
    out_dir: str, name: str, throughput: list[dict[str, Any]], encoders: list[dict[str, Any]],
    cache: list[dict[str, Any]],
) -> list[str]:  # fmt: skip
    """``<name>-{media,encoders,encoder-cache}.{json,md}``; the tables."""
    return [
        write_results(out_dir, f"{name}-media", throughput, THROUGHPUT_COLUMNS),
        write_results(out_dir, f"{name}-encoders", encoders, ENCODER_COLUMNS),
        write_results(out_dir, f"{name}-encoder-cache", cache, CACHE_COLUMNS),
    ]


def _median_ms(call: Callable[[], Any], repeats: int, device: str) -> float:
    def once() -> float:
        start = time.perf_counter()
        call()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats)) * 1e3


def thinker_decoder(folder: str | Path, device: str) -> Any:
    """The thinker with its encoders, as a stage builds and loads it."""
    from omnistage.memory import Arena
    from omnistage.models import registry
    from omnistage.models.ar_config import ARModelConfig
    from omnistage.models.loader import load_module

    config = ARModelConfig.from_pretrained(folder, model_stage="thinker")
    family = registry.ar_family(config.family)
    model = family.build_decoder(config, torch.float32)
    Arena(device).adopt(model)
    load_module(model, folder, rename=family.rename("thinker"))
    return model.eval()


def encoder_rows(
    folder: str | Path, hf_model: Any, settings: MediaSettings, device: str
) -> list[dict[str, Any]]:
    """Per audio length and image size: the family processor's and the encoder's time."""
    from omnistage.models import registry
    from omnistage.models.interfaces import supports_multimodal

    ours = thinker_decoder(folder, device)
    family = registry.family_of_folder(str(folder))
    if not supports_multimodal(family):
        raise ValueError(f"{folder}: a {family.name} model takes no media")
    processor = family.prompt_processor(folder)
    media: list[tuple[str, MediaItem, float | None]] = [
        (f"audio {s:g} s", MediaItem("audio", Audio(clip(s, seed=0), RATE), "a"), s)
        for s in settings.encoder_audio_s
    ]
    media += [
        (f"image {w}x{h}", MediaItem("image", picture(h, w, seed=0), "i"), None)
        for h, w in settings.encoder_images
    ]
    with torch.no_grad(), quiet():
        return [
            _encoder_row(label, item, seconds, ours, processor, hf_model.thinker, settings, device)
            for label, item, seconds in media
        ]


def _encoder_row(
    label: str, item: MediaItem, seconds: float | None, ours: Any, processor: Any, thinker: Any,
    settings: MediaSettings, device: str,
) -> dict[str, Any]:  # fmt: skip
    kind = item.modality
    bos, eos = (
        (processor.audio_bos, processor.audio_eos)
        if kind == "audio"
        else (processor.vision_bos, processor.vision_eos)
    )
    ids = [bos, processor.placeholder_ids[kind], eos]
    processor_ms = _median_ms(lambda: processor.process(ids, [item], {}), 2, "cpu")
    encoder_input = processor.process(ids, [item], {}).items[0]
    data = {k: v.to(device) for k, v in encoder_input.data.items()}
    encode = ours.encoders[kind]

    def theirs() -> Any:
        if kind == "audio":
            features = data["input_features"]
            mask = torch.ones(1, features.shape[1], dtype=torch.long, device=device)
            return thinker.get_audio_features(features[None], mask).last_hidden_state
        out = thinker.get_image_features(data["pixel_values"], data["image_grid_thw"])
        return torch.cat(out.pooler_output)

    with _threads(1):  # as in the thinker stage (the processor runs in the API process)
        encoder_ms = _median_ms(lambda: encode(**data), settings.encoder_repeats, device)
        transformers_ms = _median_ms(theirs, settings.encoder_repeats, device)
    return {
        "medium": label,
        "tokens": encoder_input.length,
        "processor_ms": processor_ms,
        "encoder_ms": encoder_ms,
        "encoder_ms_per_audio_s": encoder_ms / seconds if seconds else None,
        "transformers_ms": transformers_ms,
        "speedup_vs_transformers": transformers_ms / encoder_ms,
        "same_as_transformers": bool(torch.equal(encode(**data), theirs())),
    }


def _encoder_cache(omni: Any) -> dict[str, int]:
    """The first stage's (the thinker's, which takes the media) encoder-cache counters."""
    first = min(omni.stage_status(), key=lambda s: s["stage_id"])
    return dict(first["encoder_cache"])


def cache_rows(omni: Any, settings: MediaSettings) -> list[dict[str, Any]]:
    """Per medium (the largest image the folder takes, an audio clip): a request's end-to-end
    time with its medium in the encoder cache against one with a fresh content hash."""
    greedy = {"temperature": 0.0, "max_tokens": settings.cache_tokens}
    media = {
        "image {1}x{0}".format(*settings.cache_image): ("image", picture(*settings.cache_image, 1)),
        f"audio {settings.audio_s:g} s": ("audio", Audio(clip(settings.audio_s, seed=1), RATE)),
    }
    rows = []
    for label, (kind, value) in media.items():

        def send(text: str, digest: str, kind: str = kind, value: Any = value) -> float:
            prompt = {
                "messages": [{"role": "user", "content": _content(text, kind, "?")}],
                "multi_modal_data": [MediaItem(kind, value, digest)],  # type: ignore[arg-type]
            }
            start = time.perf_counter()
            omni.generate(prompt, greedy, ["text"])
            return time.perf_counter() - start

        send("Warm up:", f"bench cache {label} warm-up")
        miss: list[float] = []
        hit: list[float] = []
        queries = hits = 0
        for r in range(settings.cache_repeats):
            send(f"First {r}:", f"bench cache {label} {r}")  # untimed: puts it in the cache
            before = _encoder_cache(omni)
            pair = [(miss, "miss", " new"), (hit, "hit", "")]  # (as many tokens either way)
            for timed, word, new in pair if r % 2 == 0 else pair[::-1]:  # either goes first
                timed.append(send(f"Now {r} {word}:", f"bench cache {label} {r}{new}"))
            after = _encoder_cache(omni)
            queries += after["queries"] - before["queries"]
            hits += after["hits"] - before["hits"]
        miss_ms, hit_ms = statistics.median(miss) * 1e3, statistics.median(hit) * 1e3
        rows.append(
            {
                "medium": label,
                "requests": 2 * settings.cache_repeats,
                "miss_ms": miss_ms,
                "hit_ms": hit_ms,
                "hit_speedup": miss_ms / hit_ms,
                "encoder_queries": queries,
                "encoder_hits": hits,
            }
        )
    return rows
