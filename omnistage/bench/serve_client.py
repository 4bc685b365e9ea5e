"""One streamed request as ``omnistage bench serve`` times it, and its progress bar.

A request is sent with ``stream: true`` and ``stream_options: {"include_usage": true}``; each
server-sent event is stamped when its line arrives. What is taken from the stream (OpenAI's
shapes, so any compatible server works: omnistage, vLLM):

- text: ``choices[i].delta.content`` (chat) or ``choices[i].text`` (completions); only a
  non-empty one counts as a *content delta*;
- audio: ``choices[i].delta.audio`` with a non-empty ``data`` (base64; each chunk decodes on
  its own, as OpenAI and omnistage send them);
- ``usage`` (``prompt_tokens``, ``completion_tokens``), when the server reports it;
- an ``error`` object in the stream (a failure after the answer began).
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

PCM16_RATE = 24000  # OpenAI's pcm16: 16-bit mono at 24 kHz


class StreamError(Exception):
    """The server reported an error inside the stream."""


@dataclass
class RequestResult:
    """One request's timings in seconds, from the moment it was sent (``start``: from the
    beginning of the run)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    latency: float = 0.0  # sent → the stream's end
    ttft: float | None = None  # → the first content delta
    ttfa: float | None = None  # → the first delta.audio carrying data
    last_token: float | None = None  # → the last content delta
    itl: list[float] = field(default_factory=list)  # gaps between content deltas
    content_deltas: int = 0
    prompt_tokens: int | None = None  # the server's usage, when it reports one
    completion_tokens: int | None = None
    text: str = ""
    audio: list[bytes] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        """The server's count when it reported usage, else one token per content delta."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.content_deltas

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, over the text stream."""
        tokens = self.output_tokens
        if self.ttft is None or self.last_token is None or tokens < 2:
            return None
        return (self.last_token - self.ttft) / (tokens - 1)

    def audio_seconds(self, audio_format: str) -> float | None:
        """Seconds of the audio received (None: none, or not readable): pcm16's length (24 kHz
        mono), or the WAVs' (a chunk that starts with ``RIFF`` starts another WAV)."""
        if not self.audio:
            return None
        if audio_format == "pcm16":
            return sum(map(len, self.audio)) / 2 / PCM16_RATE
        wavs: list[bytes] = []
        for chunk in self.audio:
            if chunk.startswith(b"RIFF") or not wavs:
                wavs.append(chunk)
            else:
                wavs[-1] += chunk
        seconds = [wav_seconds(w) for w in wavs]
        return None if None in seconds else sum(s for s in seconds if s is not None)

    def detail(self) -> dict[str, Any]:
        """What ``--save-detailed`` keeps of it."""
        keys = ("success", "error", "start", "latency", "ttft", "ttfa", "tpot", "itl")
        return {k: getattr(self, k) for k in keys} | {
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "text": self.text,
            "audio_bytes": sum(map(len, self.audio)),
        }


def wav_seconds(data: bytes) -> float | None:
    """A PCM WAV's duration from its ``fmt `` chunk and the bytes its ``data`` chunk holds; a
    streamed WAV's sizes may say "unknown" (0 or 0xFFFFFFFF): then the data runs to the end."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    position, frame, rate = 12, 0, 0
    while position + 8 <= len(data):
        name, size = data[position : position + 4], struct.unpack_from("<I", data, position + 4)[0]
        body = position + 8
        if name == b"fmt " and body + 16 <= len(data):
            channels, rate = struct.unpack_from("<HI", data, body + 2)
            frame = channels * struct.unpack_from("<H", data, body + 14)[0] // 8
        elif name == b"data":
            available = len(data) - body
            held = available if size in (0, 0xFFFFFFFF) or size > available else size
            return held / frame / rate if frame and rate else None
        position = body + size + (size & 1)
    return None


def take_event(result: RequestResult, event: dict[str, Any], elapsed: float) -> None:
    """Account one parsed event, which arrived ``elapsed`` seconds after the request was sent."""
    if event.get("error") and not event.get("choices"):  # OpenAI's, omnistage's shape
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"error in the stream: {message}")
    if event.get("object") == "error":  # older vLLM's shape
        raise StreamError(f"error in the stream: {event.get('message', event)}")
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        if text:
            if result.last_token is None:
                result.ttft = elapsed
            else:
                result.itl.append(elapsed - result.last_token)
            result.last_token = elapsed
            result.content_deltas += 1
            result.text += text
        audio = delta.get("audio")
        if isinstance(audio, dict) and audio.get("data"):
            if result.ttfa is None:
                result.ttfa = elapsed
            result.audio.append(base64.b64decode(audio["data"]))


def _http_error(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error", {})
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:300].decode(errors='replace')}"


async def send(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    run_start: float,
) -> RequestResult:
    """POST one streamed request; never raises (a failure is a result with ``error``)."""
    result = RequestResult()
    sent = time.perf_counter()
    result.start = sent - run_start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = _http_error(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), other fields
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                take_event(result, json.loads(data), time.perf_counter() - sent)
        result.success = True
    except StreamError as exc:
        result.error = str(exc)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        result.latency = time.perf_counter() - sent
    return result


class Progress:
    """A progress bar of our own on stderr: redrawn in place on a terminal, a line per tenth
    otherwise (logs stay readable)."""

    WIDTH = 30

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.enabled = total, enabled and total > 0
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()
        self._tenth = 0

    def line(self) -> str:
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        elapsed = time.perf_counter() - self.start
        return f"[{bar}] {self.done}/{self.total} requests{failed}, {elapsed:.1f} s"

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
        elif self.done * 10 // self.total > self._tenth or self.done == self.total:
            self._tenth = self.done * 10 // self.total
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
