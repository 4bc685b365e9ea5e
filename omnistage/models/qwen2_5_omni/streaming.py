"""Qwen2.5-Omni's token2wav chunk by chunk, while the talker still produces codes.

The DiT's attention is block-local (a frame sees its own block, one more block back in each
``look_backward_layers`` layer and one more ahead in each ``look_ahead_layers`` one), so a
stretch of mel depends on a bounded neighbourhood of codes per DiT call — but the ODE calls
the DiT ``4 x (num_steps - 1)`` times, and each call widens that neighbourhood again. A chunk
is therefore synthesised as a *window*: the chunk's codes with ``left_context`` codes before
(its start aligned to a DiT block, so blocks fall where they fall in the whole utterance) and
``right_context`` after, solved over the whole ODE from the same noise the whole utterance
would draw there (the noise is drawn frame by frame from the seeded generator as codes
arrive: the same values as one draw for the whole utterance). The chunk's frames of the
window's mel are kept; the frames after it serve as the vocoder's look-ahead.

The BigVGAN is convolutional with a bounded reach (``vocoder_context_frames``): each chunk's
mel is vocoded between up to that many final frames before it and the window's frames after
it, and only the chunk's own samples are kept.

What this promises (``tests/unit/stage/code2wav/test_streaming.py``):

- When ``left_context`` and ``right_context`` cover the ODE's reach (``dit_reach_codes``) and
  the vocoder's, the streamed waveform equals the whole-utterance one up to float rounding
  (rotary angles are computed at window positions, not utterance positions).
- With smaller contexts (the defaults, chosen for latency), the streamed speech differs from
  the whole-utterance speech by an amount ``omnistage bench omni`` reports in dB; its cost is
  linear in the utterance's length where the whole solve's attention is quadratic.
- The same codes, seed and windows give the same samples, however the codes arrive.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from omnistage.models.omni_vocoder import CodeStream
from omnistage.models.qwen2_5_omni.code2wav import NO_GUIDANCE_BELOW, Token2WavSynthesis

ACTIVATION_REACH = 6  # samples either side of an anti-aliased activation (12-tap filters at 2x)


def vocoder_context_frames(config: Any) -> int:
    """Mel frames either side that can change a frame's samples in the BigVGAN: a bound from
    its layers (pre-conv, transposed convs, residual blocks with their activations, post-conv),
    each reach converted to mel frames at its layer's sample rate."""
    reach = 3.0  # conv_pre: kernel 7
    rate = 1
    for stride, kernel in zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True):
        reach += (kernel / stride + 1) / rate
        rate *= stride
        block_reach = max(
            sum((k - 1) // 2 * (d + 1) + 2 * ACTIVATION_REACH for d in dilations)
            for k, dilations in zip(
                config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True
            )
        )
        reach += block_reach / rate
    reach += (ACTIVATION_REACH + 3) / rate  # activation_post, conv_post (kernel 7)
    return math.ceil(reach) + 1


def dit_reach_codes(dit_config: Any, num_steps: int) -> tuple[int, int]:
    """``(behind, ahead)``: how many codes before and after a code can change its mel over a
    whole ODE solve of ``num_steps`` time points (RK4: four DiT calls per step)."""
    calls = 4 * (num_steps - 1)
    block = int(dit_config.block_size)
    behind = (calls * len(dit_config.look_backward_layers) + 1) * block
    ahead = (calls * len(dit_config.look_ahead_layers) + 1) * block
    repeats = int(dit_config.repeats)
    return math.ceil(behind / repeats), math.ceil(ahead / repeats)


class Token2WavStream(CodeStream):
    """One utterance spoken chunk by chunk. ``add_codes`` as the talker produces them,
    ``end_input`` after the last; ``advance()`` is one ODE step of the current window (the
    engine interleaves it with other utterances' steps) and runs only when ``is_ready``;
    ``take_audio()`` returns the samples finished since the last call. ``chunks`` carries
    ``first_chunk``, ``chunk``, ``left_context`` and ``right_context`` in codes."""

    def __init__(self, pipeline: Any, params: Any, seed: int, chunks: Any) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.params = params
        self.voice = params.voice or pipeline.default_voice
        self.first_chunk, self.chunk = int(chunks.first_chunk), int(chunks.chunk)
        self.left_context, self.right_context = int(chunks.left_context), int(chunks.right_context)
        self.repeats = int(pipeline.repeats)
        block = int(pipeline.dit.config.block_size)
        self.unit = math.lcm(block, self.repeats) // self.repeats  # codes per aligned step
        self.context_frames = vocoder_context_frames(pipeline.vocoder.config)
        self.hop = math.prod(int(r) for r in pipeline.vocoder.config.upsample_rates)
        self._generator = torch.Generator("cpu").manual_seed(seed)
        self._noise = torch.empty([1, 0, pipeline.mel_dim])
        self.done_codes = 0  # codes whose samples are out
        self._window: Token2WavSynthesis | None = None
        self._span = (0, 0, 0, 0)  # the window's codes: start, chunk start, chunk end, end
        self._tail = torch.empty([1, 0, pipeline.mel_dim], device=pipeline.device)
        self.num_windows = 0

    def add_codes(self, codes: list[int]) -> None:
        if self.ended:
            raise ValueError("codes after the end of the input")
        if not codes:
            return
        self.codes.extend(codes)
        frames = len(codes) * self.repeats
        draw = torch.randn(
            [1, frames, self.pipeline.mel_dim], generator=self._generator, dtype=torch.float32
        )
        self._noise = torch.cat([self._noise, draw], dim=1)

    def _next_span(self) -> tuple[int, int, int, int] | None:
        start, available = self.done_codes, len(self.codes)
        end = self.first_chunk if start == 0 else start + self.chunk
        if self.ended:
            end = min(end, available)
        elif available < end + self.right_context:
            return None
        if end <= start:
            return None
        window_start = max(0, start - self.left_context) // self.unit * self.unit
        return window_start, start, end, min(available, end + self.right_context)

    @property
    def is_ready(self) -> bool:
        """Whether ``advance`` has work now (a window under way, or a chunk's codes in)."""
        return self._window is not None or self._next_span() is not None

    @property
    def is_done(self) -> bool:
        return self.ended and self._window is None and self.done_codes >= len(self.codes)

    def current(self) -> Token2WavSynthesis:
        """The window to step next (started from the next chunk's span if none is under way;
        only when ``is_ready``)."""
        if self._window is None:
            span = self._next_span()
            if span is None:
                raise RuntimeError("no chunk is ready to synthesise")
            self._span = span
            start, end = span[0], span[3]
            frames = slice(start * self.repeats, end * self.repeats)
            self._window = Token2WavSynthesis(
                self.pipeline, self.codes[start:end], self.params, 0, noise=self._noise[:, frames]
            )
            self.num_windows += 1
        return self._window

    @property
    def batch_key(self) -> Any:
        """The next step's ``Token2WavSynthesis.batch_key`` (streams with equal keys step
        together); None when not ready."""
        if self._window is not None:
            return self._window.batch_key
        span = self._next_span()
        if span is None or self.params.guidance_scale < NO_GUIDANCE_BELOW:
            return None
        return (span[3] - span[0]) * self.repeats, int(self.pipeline.mel_dim)

    def settle(self) -> None:
        """After a step of the current window: a finished window's chunk is spoken."""
        if self._window is not None and self._window.is_done:
            self._vocode(self._window.mel())
            self._window = None

    @torch.inference_mode()
    def advance(self) -> None:
        if not self.is_ready:
            return
        self.current().advance()
        self.settle()

    def _vocode(self, mel: torch.Tensor) -> None:
        """Keep the chunk's mel and speak it, between the final frames before it and the
        window's frames after it."""
        window_start, start, end, _ = self._span
        first = (start - window_start) * self.repeats
        last = (end - window_start) * self.repeats
        chunk = mel[:, first:last]
        ahead = mel[:, last : last + self.context_frames]
        behind = self._tail
        frames = torch.cat([behind, chunk, ahead], dim=1)
        samples = self.pipeline.vocoder(frames.permute(0, 2, 1)).reshape(-1).float()
        if samples.numel() != frames.shape[1] * self.hop:
            raise RuntimeError(
                f"the vocoder made {samples.numel()} samples of {frames.shape[1]} mel frames; "
                f"expected {self.hop} per frame"
            )
        keep = slice(behind.shape[1] * self.hop, (behind.shape[1] + chunk.shape[1]) * self.hop)
        self._audio.append(samples[keep].clone())
        self._tail = torch.cat([behind, chunk], dim=1)[:, -self.context_frames :]
        self.done_codes = end
