"""Qwen3-Omni's code2wav (and Qwen3-TTS's decoder, built of the same parts) chunk by chunk
while the talker still speaks, such that the chunks, joined, are the whole decode's waveform
(``Code2WavSynthesis``: transformers' ``chunked_decode``). The decoder is causal, so a decode
of ``n`` frames makes the ``n * samples_per_frame - samples_lost`` samples later frames cannot
change (``samples_lost``, ``context_samples``: ``DecoderReach``; none lost where transposed
convs trim only their right end, as Qwen3-TTS's); a stream follows ``chunked_decode``'s
300-frame windows and, inside one, decodes its first frames as soon as they are final — over
a multiple of ``ROW_ALIGN`` frames, only once every convolution (the stack's, and those before
the pre-transformer) runs the kernel it runs in the whole window, starting ``context_samples``
before the first sample to hand out, and handing out only the rows the pre-transformer has
made final whatever the window's length turns out to be (``latents_settle``: all of them, or
the first half of a decode where the CPU's GEMM splits a long attention's sum over the keys).
Why each rule is needed, what is bit for bit and what is not: ``docs/qwen3-omni.md``,
*Code2wav*, *Streamed*; ``docs/tts.md``, *Streamed speech*.

``chunks`` (the stage config's ``stream_chunks``) count frames (talker steps): the first chunk
goes out when ``first_chunk`` frames are final, each later one when ``chunk`` more are, the
rest of a window when it is finished. A request's own ``first_chunk`` (``Code2WavParams``)
sends the first chunk once that many frames are in, decoded from them alone (not final); the
rest as above. A clone's ``context_frames`` come first and their samples are cut
(``Code2WavStream._cut``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.omni_vocoder import CodeStream

ROW_ALIGN = 16  # AVX-512's float lanes; a multiple of AVX2's 8 and NEON's 4


def _is_decoder(module: nn.Module) -> bool:
    """A whole decoder (Qwen3-Omni's ``Qwen3OmniMoeCode2Wav``, Qwen3-TTS's
    ``SpeechDecoder``): a pre-transformer, then the ``upsample`` and ``decoder`` stacks."""
    return hasattr(module, "pre_transformer") and all(
        isinstance(getattr(module, name, None), nn.ModuleList) for name in ("upsample", "decoder")
    )


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
    if _is_decoder(module):  # the stack only: the pre-transformer's part is not walked
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
    # transposed: output j (after the left cut) reads inputs (j + left_pad - kernel) // s + 1
    # .. (j + left_pad) // s; a conv trimming only its right end (Qwen3-TTS's, left_pad 0)
    # reads no input ahead, and its first s outputs read the input before the decode's first
    inner = conv.conv
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
    (555 in the real Qwen3-Omni model): the last samples of each decoder block's transposed
    conv need the next frame. ``chunked_decode`` loses them at every window end. None in
    Qwen3-TTS's decoder, whose transposed convs trim only their right end."""
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


SETTLE_ALL, SETTLE_HALF, SETTLE_WINDOW = "all", "half", "window"


@torch.inference_mode()
def latents_settle(module: nn.Module, device: torch.device, window: int) -> str:
    """Which rows of a decode of ``K`` frames the pre-transformer computes as every longer
    decode does, probed on random inputs (a decode of ``K`` rows against the canonical rows:
    each from the shortest ``ROW_ALIGN``-row decode that holds it). ``SETTLE_ALL``: all but
    its last partial ``ROW_ALIGN`` block. ``SETTLE_HALF``: its first ``K // 2`` (the CPU's
    GEMM splits a long attention's sum over the keys at half their count, so the rows whose
    sliding window straddles that split, and the rows after them that attend to those, depend
    on ``K``: Qwen3-TTS's heads of 32 and 64; Qwen3-Omni's tiny heads of 8 are not split).
    ``SETTLE_WINDOW``: neither holds; only a finished window is final."""
    transformer: Any = module.pre_transformer
    width = int(transformer.config.hidden_size)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, window, width, generator=generator).to(device)

    def decode(rows: int) -> torch.Tensor:
        return transformer(inputs_embeds=x[:, :rows]).last_hidden_state[0]

    blocks = [decode(rows) for rows in range(ROW_ALIGN, window + ROW_ALIGN, ROW_ALIGN)]
    canonical = torch.cat([b[i * ROW_ALIGN : (i + 1) * ROW_ALIGN] for i, b in enumerate(blocks)])
    lengths = [*range(ROW_ALIGN, window, 7), window]

    def holds(keep: Any) -> bool:
        return all(torch.equal(decode(k)[: keep(k)], canonical[: keep(k)]) for k in lengths)

    if holds(lambda k: k // ROW_ALIGN * ROW_ALIGN):
        return SETTLE_ALL
    return SETTLE_HALF if holds(lambda k: k // 2) else SETTLE_WINDOW


class DecoderReach:
    """A decoder's ``samples_lost`` and ``context_samples``, and the kernels a decode of a
    given length runs (``conv_backends``: the stack's; ``front_backends``: the convolutions
    before the pre-transformer, Qwen3-TTS's ``front_convs``; cached per length and torch
    thread count: a 1x1 convolution runs on oneDNN only with several threads)."""

    def __init__(
        self,
        module: nn.Module,
        samples_per_frame: int,
        device: torch.device,
        *,
        settle: str | None = None,
    ) -> None:
        self.module = module
        self.device = device
        self.samples_lost = samples_lost(module, samples_per_frame)
        self.context_samples = context_samples(module)
        # which rows of an unfinished window's decode are final (``latents_settle``)
        self.settle = settle or SETTLE_ALL
        front = getattr(module, "front_convs", None)
        self.front: list[tuple[nn.Module, int]] = front() if front is not None else []
        self._backends: dict[tuple[str, int, int], tuple[Any, ...]] = {}

    def conv_backends(self, frames: int) -> tuple[Any, ...]:
        key = ("stack", frames, torch.get_num_threads())
        if key not in self._backends:
            self._backends[key] = tuple(
                conv_backend(conv, width, self.device)
                for conv, width in conv_inputs(self.module, frames)
            )
        return self._backends[key]

    def front_backends(self, frames: int) -> tuple[Any, ...]:
        key = ("front", frames, torch.get_num_threads())
        if key not in self._backends:
            self._backends[key] = tuple(
                conv_backend(conv, frames + extra, self.device) for conv, extra in self.front
            )
        return self._backends[key]

    def kernels_agree(self, rows: int, frames: int) -> bool:
        """Whether a decode of ``rows`` frames runs every convolution with the kernel a decode
        of ``frames`` runs it with."""
        return self.front_backends(rows) == self.front_backends(frames) and self.conv_backends(
            rows
        ) == self.conv_backends(frames)


class Code2WavStream(CodeStream):
    """One utterance spoken chunk by chunk. ``add_codes`` as the talker produces frames (flat,
    whole frames), ``end_input`` after the last; ``advance()`` decodes the next chunk when
    ``is_ready``; ``take_audio()`` returns the samples finished since the last call.

    ``params.context_frames`` (a clone's reference, the first frames to arrive): decoded with
    the rest, their samples cut as ``Code2WavSynthesis`` cuts them — ``int(ref / total *
    samples)``, which float rounding makes one sample short of ``ref * samples_per_frame`` for
    some totals (4.3% of them): exact when the input has ended before anything is spoken,
    else ``ref * samples_per_frame``. ``params.first_chunk``: the first chunk goes out once
    that many frames follow the context, decoded from them alone (``early``)."""

    batch_key = None  # never shares a forward (see ``code2wav``)

    def __init__(self, vocoder: Any, params: Any, chunks: Any) -> None:
        super().__init__()
        self.vocoder = vocoder
        self.voice = getattr(params, "voice", None) or vocoder.default_voice
        early = getattr(params, "first_chunk", None)
        self.early = early is not None  # the first chunk from the frames so far, not final
        self.first_chunk = max(1, int(early if early is not None else chunks.first_chunk))
        self.chunk = max(1, int(chunks.chunk))
        self.groups = int(vocoder.codes_per_frame)
        self.reach = vocoder.reach
        self.context = int(getattr(params, "context_frames", 0) or 0)
        self._fixed_cut: int | None = None  # set by the first decode (``_cut``)
        self.window_index = 0  # the window being spoken (windows wholly in the context: none)
        while self.vocoder.window(self.window_index)[2] < self.context:
            self.window_index += 1
        self._handed = 0  # samples of that window handed out, counted from its first frame
        self.frames_out = self.context  # frames up to the last chunk's end
        self.num_chunks = 0
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

    def _cut(self) -> int:
        """The utterance's first sample handed out: ``Code2WavSynthesis``'s cut when the input
        ended before the first decode (the total known), else ``context * samples_per_frame``
        (what the cut is but for float rounding)."""
        if self._fixed_cut is not None:
            return self._fixed_cut
        per_frame = int(self.vocoder.samples_per_frame)
        if not self.context:
            return 0
        if self.ended:
            total = max(self.num_frames, 1)
            context = min(self.context, total)
            return int(context / total * (total * per_frame))
        return self.context * per_frame

    def _next(self) -> tuple[int, int, int, int] | None:
        """The next decode: ``(first, start, rows, final)`` — frames ``[first, first + rows)``
        of the current window, which keeps samples from frame ``start`` up to frame ``first +
        final`` (all ``rows`` when the window is finished); None when no chunk is due."""
        first, start, end = self.vocoder.window(self.window_index)
        available = self.num_frames
        if available >= end:
            return first, start, end - first, end - first
        if self.ended:
            return None if available <= start else (first, start, *[available - first] * 2)
        if self.early and not self.num_chunks:
            if available - self.frames_out < self.first_chunk:
                return None
            return first, start, available - first, available - first  # not final: early
        rows = (available - first) // ROW_ALIGN * ROW_ALIGN
        final = {SETTLE_ALL: rows, SETTLE_HALF: rows // 2}.get(self.reach.settle, 0)
        due = self.first_chunk if not self.num_chunks else self.chunk
        if (
            first + final - self.frames_out < due
            or self._stop(final) <= self._keep(first, start)
            # the whole decode's convolutions may still run other kernels than ours
            or not self.reach.kernels_agree(rows, end - first)
        ):
            return None
        return first, start, rows, final

    def _stop(self, final: int) -> int:
        """The end of the samples a decode makes final when its first ``final`` frames are
        (window samples): less those that read the frame after (``samples_lost``)."""
        return final * int(self.vocoder.samples_per_frame) - int(self.reach.samples_lost)

    def _keep(self, first: int, start: int) -> int:
        """The window's first sample not handed out yet (none before the context's cut)."""
        per_frame = int(self.vocoder.samples_per_frame)
        return max(self._handed, (start - first) * per_frame, self._cut() - first * per_frame)

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
        self._fixed_cut = self._cut()
        first, start, rows, final = step
        finished = first + rows >= self.vocoder.window(self.window_index)[2] or self.ended
        keep, stop = self._keep(first, start), self._stop(final)
        if stop > keep:  # else the window is all context: nothing to decode
            self._decode(first, rows, keep, stop, whole=finished and not self._handed)
        self.frames_out = max(self.frames_out, first + final)
        if finished:
            self.window_index += 1
            self._handed = 0
        else:
            self._handed = stop

    def _decode(self, first: int, rows: int, keep: int, stop: int, *, whole: bool) -> None:
        """Frames ``[first, first + rows)`` of the window decoded, its samples ``[keep, stop)``
        handed out."""
        v, reach = self.vocoder, self.reach
        per_frame = int(v.samples_per_frame)
        g = self.groups
        codes = v.codes_tensor(self.codes[first * g : (first + rows) * g])
        hidden = v.hidden_states(codes)
        skip = 0  # a window spoken in one decode is decoded as the whole decode decodes it
        if not whole:
            # the convolutions start far enough back for their zero padding to miss ``keep``,
            # and for each to run the kernel it runs in the whole decode
            skip = max(0, (keep - int(reach.context_samples)) // per_frame)
            kernels = reach.conv_backends(rows)
            while skip and reach.conv_backends(rows - skip) != kernels:
                skip -= 1
        wav = v.upsample(hidden[:, skip:]).reshape(-1)
        self._audio.append(wav[keep - skip * per_frame : stop - skip * per_frame].float().cpu())
        self.num_decodes += 1
        self.num_chunks += 1
