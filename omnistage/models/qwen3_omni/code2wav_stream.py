"""Qwen3-Omni's code2wav chunk by chunk while the talker still speaks, such that the chunks,
joined, are the whole decode's waveform (``Code2WavSynthesis``: transformers'
``chunked_decode``). The decoder is causal, so a decode of ``n`` frames makes the
``n * samples_per_frame - samples_lost`` samples later frames cannot change (``samples_lost``,
``context_samples``: ``DecoderReach``); a stream follows ``chunked_decode``'s 300-frame windows
and, inside one, decodes its first frames as soon as they are final — over a multiple of
``ROW_ALIGN`` frames, only once every convolution runs the kernel it runs in the whole window,
starting ``context_samples`` before the first sample to hand out. Why each rule is needed,
what is bit for bit and what is not: ``docs/qwen3-omni.md``, *Code2wav*, *Streamed*.

``chunks`` (the stage config's ``stream_chunks``) count frames (talker steps): the first chunk
goes out when ``first_chunk`` frames are final, each later one when ``chunk`` more are, the
rest of a window when it is finished.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.omni_vocoder import CodeStream

ROW_ALIGN = 16  # AVX-512's float lanes; a multiple of AVX2's 8 and NEON's 4


def _walk(module: nn.Module, value: int, rule: Any) -> int:
    """Fold ``rule(kind, conv, value)`` over the convolutions of the decoder's stack (after
    the pre-transformer) in the order ``forward`` runs them; residual blocks take the longer of
    their two paths (``max`` of the value through the body and around it)."""
    kind = type(module).__name__
    if kind.endswith("CausalConvNet"):
        return int(rule("conv", module, value))
    if kind.endswith("CausalTransConvNet"):
        return int(rule("transposed", module, value))
    if kind.endswith(("ConvNeXtBlock", "ResidualUnit")):
        body = value
        for child in module.children():
            body = _walk(child, body, rule)
        return max(body, value)
    if kind == "Qwen3OmniMoeCode2Wav":
        for blocks in module.upsample:  # type: ignore[union-attr]
            for block in blocks:
                value = _walk(block, value, rule)
        for block in module.decoder:  # type: ignore[union-attr]
            value = _walk(block, value, rule)
        return value
    for child in module.children():  # decoder blocks (ModuleList), activations, norms
        value = _walk(child, value, rule)
    return value


def _clean_from(kind: str, conv: Any, first_clean: int) -> int:
    """The first output index that does not see a layer's zero padding before its input."""
    if kind == "conv":  # causal: output t reads inputs t - padding .. t
        return first_clean + int(conv.padding)
    inner = conv.conv  # transposed: output j (after the left cut) reads inputs up to j // s + 1
    stride, kernel = int(inner.stride[0]), int(inner.kernel_size[0])
    return max(0, (first_clean - 1) * stride + kernel - int(conv.left_pad))


def _length(kind: str, conv: Any, length: int) -> int:
    if kind == "conv":
        if int(conv.stride) != 1:
            raise CheckpointError(f"code2wav: a causal conv of stride {conv.stride} (expected 1)")
        return length  # as long as its input
    inner = conv.conv
    stride, kernel = int(inner.stride[0]), int(inner.kernel_size[0])
    return (length - 1) * stride + kernel - int(conv.left_pad) - int(conv.right_pad)


def context_samples(module: nn.Module) -> int:
    """Samples at the start of a decode that depend on the zero padding before its first
    frame: a decode starting ``f`` frames into a window gives the window's own samples from
    ``f * samples_per_frame + context_samples`` on (17454 samples, 9.1 frames, in the real
    model; a stream starts its decodes that far back)."""
    return _walk(module, 0, _clean_from)


def conv_inputs(module: nn.Module, frames: int) -> list[tuple[nn.Module, int]]:
    """Each convolution of a decode of ``frames`` frames (the ``nn.Conv1d`` or
    ``nn.ConvTranspose1d``) with the length of its input, in the order ``forward`` runs them."""
    found: list[tuple[nn.Module, int]] = []

    def record(kind: str, conv: Any, length: int) -> int:
        if kind == "conv":
            found.append((conv.conv, length + int(conv.padding)))  # stride 1: no extra padding
        else:
            found.append((conv.conv, length))
        return _length(kind, conv, length)

    _walk(module, frames, record)
    return found


def samples_lost(module: nn.Module, samples_per_frame: int) -> int:
    """How many samples a decode of ``n`` frames falls short of ``n * samples_per_frame``
    (555 in the real model): the last samples of each decoder block's transposed conv need the
    next frame. ``chunked_decode`` loses them at every window end."""
    frames = 4
    return frames * samples_per_frame - _walk(module, frames, _length)


def conv_backend(conv: nn.Module, width: int, device: torch.device) -> Any:
    """The kernel family torch runs ``conv`` with on an input of ``width`` samples (ATen's
    choice by shape: on the CPU a float32 convolution with at most 20480 input elements runs
    ATen's own im2col + GEMM, a larger one oneDNN, and the two round differently). None where
    this torch cannot say."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        return None
    probe = torch.empty(1, device=device).expand(1, int(conv.in_channels), width)  # type: ignore[arg-type]
    return select(
        probe,
        conv.weight,
        conv.bias,
        list(conv.stride),  # type: ignore[arg-type]
        list(conv.padding),  # type: ignore[arg-type]
        list(conv.dilation),  # type: ignore[arg-type]
        isinstance(conv, nn.ConvTranspose1d),
        list(conv.output_padding),  # type: ignore[arg-type]
        int(conv.groups),  # type: ignore[arg-type]
        None,
    )


class DecoderReach:
    """A decoder's ``samples_lost`` and ``context_samples``, and the kernels a decode of a
    given length runs (``conv_backends``, cached per length and torch thread count: a 1x1
    convolution runs on oneDNN only with several threads)."""

    def __init__(self, module: nn.Module, samples_per_frame: int, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.samples_lost = samples_lost(module, samples_per_frame)
        self.context_samples = context_samples(module)
        self._backends: dict[tuple[int, int], tuple[Any, ...]] = {}

    def conv_backends(self, frames: int) -> tuple[Any, ...]:
        key = (frames, torch.get_num_threads())
        if key not in self._backends:
            self._backends[key] = tuple(
                conv_backend(conv, width, self.device)
                for conv, width in conv_inputs(self.module, frames)
            )
        return self._backends[key]


class Code2WavStream(CodeStream):
    """One utterance spoken chunk by chunk. ``add_codes`` as the talker produces frames (flat,
    whole frames), ``end_input`` after the last; ``advance()`` decodes the next chunk when
    ``is_ready``; ``take_audio()`` returns the samples finished since the last call."""

    batch_key = None  # never shares a forward (see ``code2wav``)

    def __init__(self, vocoder: Any, params: Any, chunks: Any) -> None:
        super().__init__()
        self.vocoder = vocoder
        self.voice = getattr(params, "voice", None) or vocoder.default_voice
        self.first_chunk = max(1, int(chunks.first_chunk))
        self.chunk = max(1, int(chunks.chunk))
        self.groups = int(vocoder.codes_per_frame)
        self.reach = vocoder.reach
        self.window_index = 0  # the window being spoken
        self._handed = 0  # samples of that window handed out, counted from its first frame
        self.frames_out = 0  # frames up to the last chunk's end
        self.num_decodes = 0

    @property
    def num_frames(self) -> int:
        return len(self.codes) // self.groups

    def add_codes(self, codes: list[int]) -> None:
        if self.ended:
            raise ValueError("codes after the end of the input")
        if len(codes) % self.groups:
            raise ValueError(f"{len(codes)} codes are not whole frames of {self.groups} codes")
        self.codes.extend(codes)

    def _next(self) -> tuple[int, int, int, bool] | None:
        """The next decode: ``(first, start, rows, finished)`` — frames ``[first, first +
        rows)`` of the current window, which keeps samples from frame ``start``; None when no
        chunk is due."""
        first, start, end = self.vocoder.window(self.window_index)
        available = self.num_frames
        if available >= end:
            rows, finished = end - first, True
        elif self.ended:
            if available <= start:
                return None
            rows, finished = available - first, True
        else:
            rows, finished = (available - first) // ROW_ALIGN * ROW_ALIGN, False
            due = self.first_chunk if self.frames_out == 0 else self.chunk
            if (
                first + rows - self.frames_out < due
                or self._stop(rows) <= self._keep(first, start)
                # the whole decode's convolutions may still run other kernels than ours
                or self.reach.conv_backends(rows) != self.reach.conv_backends(end - first)
            ):
                return None
        return first, start, rows, finished

    def _stop(self, rows: int) -> int:
        """The end of the samples a decode of ``rows`` frames makes (window samples)."""
        return rows * int(self.vocoder.samples_per_frame) - int(self.reach.samples_lost)

    def _keep(self, first: int, start: int) -> int:
        """The window's first sample not handed out yet."""
        return max(self._handed, (start - first) * int(self.vocoder.samples_per_frame))

    @property
    def is_ready(self) -> bool:
        """Whether ``advance`` has a chunk to decode now."""
        return self._next() is not None

    @property
    def is_done(self) -> bool:
        return self.ended and self.vocoder.window(self.window_index)[1] >= self.num_frames

    @torch.inference_mode()
    def advance(self) -> None:
        step = self._next()
        if step is None:
            return
        first, start, rows, finished = step
        keep, stop = self._keep(first, start), self._stop(rows)
        v, reach = self.vocoder, self.reach
        per_frame = int(v.samples_per_frame)
        g = self.groups
        codes = v.codes_tensor(self.codes[first * g : (first + rows) * g])
        hidden = v.hidden_states(codes)
        skip = 0  # a window spoken in one decode is decoded as the whole decode decodes it
        if not finished or self._handed:
            # the convolutions start far enough back for their zero padding to miss ``keep``,
            # and for each to run the kernel it runs in the whole decode
            skip = max(0, (keep - int(reach.context_samples)) // per_frame)
            kernels = reach.conv_backends(rows)
            while skip and reach.conv_backends(rows - skip) != kernels:
                skip -= 1
        wav = v.upsample(hidden[:, skip:]).reshape(-1)
        self._audio.append(wav[keep - skip * per_frame : stop - skip * per_frame].float().cpu())
        self.num_decodes += 1
        self.frames_out = first + rows
        if finished:
            self.window_index += 1
            self._handed = 0
        else:
            self._handed = stop
