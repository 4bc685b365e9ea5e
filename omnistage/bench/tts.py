"""Qwen3-TTS speech over ``/v1/audio/speech``, as a client hears it, against the official
``qwen-tts`` package in the same run: ``omnistage serve`` of each preset (streamed raw PCM,
``stream_format: audio``) one request at a time and 8 at once, and the package's
``Qwen3TTSModel.generate_custom_voice`` on the same folder, one call per request and one
call for all 8 (its own batching), on one torch thread as each of the two stages computes (so
both make the same float sums; at these sizes the package is bound by Python, not by cores). Every request is greedy (``temperature: 0``; the package's
``do_sample`` and ``subtalker_dosample`` off) with the same texts, speakers and frame bound,
so both make the same speech; ``as_package`` counts the requests whose 16-bit samples are the
package's within one step.

Columns: ``ttfa_ms`` (request sent -> its first audio bytes; for the package, which returns
whole waveforms, the whole call), ``e2e_ms`` (-> the last byte), ``ttfa_vs_e2e``,
``speech_s`` (seconds of speech per request), ``rtf`` (``e2e_ms`` / the speech's length:
below 1 is faster than real time), ``requests_per_s``, and its ratios to the package one call
at a time (``vs_reference_1``) and batched (``vs_reference_batch``). Then two long utterances
(``LONG_FRAMES``) one after the other: answered whole, streamed, and streamed with an early
first chunk (``initial_codec_chunk_frames``), their ``as_package`` column saying whether the
speech is the whole answer's. The package is loaded
through ``tests/qwen3_tts_reference.py`` (its stubs for modules with no build here), so this
benchmark runs from a source checkout with the development extras.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.bench.report import write_results
from omnistage.bench.served import Served

PIPELINES = ("tiny-qwen3-tts-customvoice", "bench-qwen3-tts-customvoice")
TEXTS = (
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Please leave your message after the tone.",
    "It is going to rain this afternoon, take an umbrella.",
    "Our next stop is the central station.",
    "Thank you for calling, we will be right with you.",
    "Seven green apples sat on the kitchen table.",
    "Read the instructions twice before you begin.",
)
SPEAKERS = ("vivian", "serena", "ryan", "aiden", "vivian", "serena", "ryan", "aiden")
FRAMES = 32  # frames (12.5 per second of speech) each request may make
LONG_FRAMES = 160  # the streamed rows': 12.8 s of speech (the bench preset speaks to its bound)
EARLY_CHUNK = 8  # the streamed rows' initial_codec_chunk_frames
RATE = 24000
COLUMNS = ["preset", "engine", "concurrency", "requests", "ttfa_ms", "e2e_ms", "ttfa_vs_e2e",
           "speech_s", "rtf", "requests_per_s", "vs_reference_1", "vs_reference_batch",
           "as_package"]  # fmt: skip


def _body(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "input": TEXTS[i], "voice": SPEAKERS[i], "language": "english", "response_format": "pcm",
        "stream_format": "audio", "temperature": 0, "max_new_tokens": FRAMES, **extra,
    }  # fmt: skip


async def _speak(client: Any, url: str, i: int, **extra: Any) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    pcm = bytearray()
    body = _body(i, **extra)
    async with client.stream("POST", url + "/v1/audio/speech", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"request {i}: {reply.status_code} {(await reply.aread())[:200]!r}")
        async for piece in reply.aiter_bytes():
            if piece and first is None:
                first = time.perf_counter() - start
            pcm += piece
    end = time.perf_counter() - start
    return {"ttfa": first or end, "e2e": end, "pcm": np.frombuffer(bytes(pcm), "<i2")}


async def _served_pass(url: str, concurrency: int) -> tuple[list[dict[str, Any]], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        await _speak(client, url, 0)  # warm-up
        start = time.perf_counter()
        if concurrency == 1:
            results = [await _speak(client, url, i) for i in range(len(TEXTS))]
        else:
            results = list(
                await asyncio.gather(*(_speak(client, url, i) for i in range(len(TEXTS))))
            )
        return results, time.perf_counter() - start


async def _long_pass(url: str, **extra: Any) -> tuple[list[dict[str, Any]], float]:
    """Two long utterances one after the other (the streamed rows)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = [
            await _speak(client, url, i, max_new_tokens=LONG_FRAMES, **extra) for i in (0, 1)
        ]
        return results, time.perf_counter() - start


def _reference(folder: Path) -> Any:
    """The package's ``Qwen3TTSModel`` over ``folder``, built as its ``from_pretrained`` would
    (which breaks on transformers 5.25: a doubled ``_from_auto``): the model's state dict from
    ``model.safetensors``, the speech tokenizer from ``speech_tokenizer/``."""
    import json

    import torch
    from safetensors.torch import load_file

    from tests.qwen3_tts_reference import qwen_tts

    package = qwen_tts()
    from qwen_tts.core.models import (
        Qwen3TTSConfig,
        Qwen3TTSForConditionalGeneration,
        Qwen3TTSProcessor,
    )
    from transformers import PreTrainedTokenizerFast

    config = Qwen3TTSConfig(**json.loads((folder / "config.json").read_text()))
    model = Qwen3TTSForConditionalGeneration(config).eval().to(torch.float32)
    missing = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    if missing.unexpected_keys or [k for k in missing.missing_keys if "inv_freq" not in k]:
        raise RuntimeError(f"the package cannot load {folder}: {missing}")
    model.load_speech_tokenizer(
        package.Qwen3TTSTokenizer.from_pretrained(str(folder / "speech_tokenizer"))
    )
    text = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|im_end|>"
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    return package.Qwen3TTSModel(model, Qwen3TTSProcessor(tokenizer=text), generation)


def _reference_call(model: Any, indices: Sequence[int]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        wavs, _ = model.generate_custom_voice(
            text=[TEXTS[i] for i in indices], speaker=[SPEAKERS[i] for i in indices],
            language=["english"] * len(indices), do_sample=False, subtalker_dosample=False,
            max_new_tokens=FRAMES,
        )  # fmt: skip
    return [(np.clip(w, -1, 1) * 32767.0).round().astype("<i2") for w in wavs]


def _reference_passes(folder: Path) -> dict[int, tuple[list[dict[str, Any]], float]]:
    """The package one call per request, then one call for all: per-request times (a
    batched call's requests all end when it does) and the pass's seconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage computes (an equal share of the cores): same sums
    try:
        return _reference_timed(_reference(folder))
    finally:
        torch.set_num_threads(threads)


def _reference_timed(model: Any) -> dict[int, tuple[list[dict[str, Any]], float]]:
    _reference_call(model, [0])  # warm-up
    one: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i in range(len(TEXTS)):
        t = time.perf_counter()
        (pcm,) = _reference_call(model, [i])
        one.append({"ttfa": time.perf_counter() - t, "e2e": time.perf_counter() - t, "pcm": pcm})
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    pcms = _reference_call(model, range(len(TEXTS)))
    batched = time.perf_counter() - start
    batch = [{"ttfa": batched, "e2e": batched, "pcm": pcm} for pcm in pcms]
    return {1: (one, sequential), len(TEXTS): (batch, batched)}


def _long_row(preset: str, case: str, results: list[dict[str, Any]], seconds: float,
              whole: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """A streamed row: its times, and whether its speech is the whole answer's."""
    ttfa = statistics.mean(r["ttfa"] for r in results)
    e2e = statistics.mean(r["e2e"] for r in results)
    same = sum(_same(r["pcm"], w["pcm"]) for r, w in zip(results, whole, strict=True))
    return {
        "preset": preset, "engine": f"omnistage {case}", "concurrency": 1,
        "requests": len(results), "ttfa_ms": ttfa * 1e3, "e2e_ms": e2e * 1e3,
        "ttfa_vs_e2e": ttfa / e2e,
        "speech_s": statistics.mean(len(r["pcm"]) / RATE for r in results),
        "rtf": statistics.mean(r["e2e"] / max(len(r["pcm"]) / RATE, 1e-9) for r in results),
        "requests_per_s": len(results) / seconds, "as_package": f"{same}/{len(results)} as whole",
    }  # fmt: skip


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and bool(np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 1)


def _row(preset: str, engine: str, concurrency: int, results: list[dict[str, Any]],
         seconds: float, reference: dict[int, tuple[list[dict[str, Any]], float]]) -> dict[str, Any]:  # fmt: skip
    n = len(results)
    ttfa = statistics.mean(r["ttfa"] for r in results)
    e2e = statistics.mean(r["e2e"] for r in results)
    audio = statistics.mean(len(r["pcm"]) / RATE for r in results)
    rate = n / seconds
    want = reference[1][0]
    same = sum(_same(r["pcm"], w["pcm"]) for r, w in zip(results, want, strict=True))
    return {
        "preset": preset, "engine": engine, "concurrency": concurrency, "requests": n,
        "ttfa_ms": ttfa * 1e3, "e2e_ms": e2e * 1e3, "ttfa_vs_e2e": ttfa / e2e,
        "speech_s": audio, "rtf": statistics.mean(r["e2e"] / max(len(r["pcm"]) / RATE, 1e-9)
                                                  for r in results),
        "requests_per_s": rate, "vs_reference_1": rate * reference[1][1] / n,
        "vs_reference_batch": rate * reference[n][1] / n, "as_package": f"{same}/{n}",
    }  # fmt: skip


def run(out_dir: str, device: str = "cpu", pipelines: Sequence[str] = PIPELINES) -> str:
    """Write ``tts-<device>.{json,md}``; return the table."""
    from omnistage.models.tiny import ensure_preset
    from omnistage.pipelines import cache_dir

    rows = []
    for preset in pipelines:
        folder = ensure_preset(preset, cache_dir() / preset)
        reference = _reference_passes(folder)
        for concurrency, (results, seconds) in reference.items():
            rows.append(_row(preset, "qwen-tts", concurrency, results, seconds, reference))
        with Served("--pipeline", preset, "--device", device) as server:
            for concurrency in (1, len(TEXTS)):
                results, seconds = asyncio.run(_served_pass(server.url, concurrency))
                rows.append(_row(preset, "omnistage", concurrency, results, seconds, reference))
            whole, seconds = asyncio.run(_long_pass(server.url, stream_format=None))
            rows.append(_long_row(preset, "whole", whole, seconds, whole))
            for case, extra in (
                ("streamed", {}),
                ("early chunk", {"initial_codec_chunk_frames": EARLY_CHUNK}),
            ):
                results, seconds = asyncio.run(_long_pass(server.url, **extra))
                rows.append(_long_row(preset, case, results, seconds, whole))
    return write_results(out_dir, f"tts-{device.replace(':', '')}", rows, COLUMNS)
