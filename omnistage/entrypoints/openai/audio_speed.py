"""A speech answer's ``speed``: the waveform stretched in time, its pitch kept.

The phase vocoder vLLM-Omni applies (torchaudio's ``Spectrogram`` -> ``TimeStretch`` ->
``InverseSpectrogram``, 768-point Hann window, hop 192), written on ``torch.stft``: each output
frame interpolates the magnitudes of the two input frames around its fractional position and
advances its phase by the measured instantaneous frequency. The result has ``len / speed``
samples. Applied to a whole utterance, after the stages have made it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

N_FFT = 768  # a speech-sized window (vLLM-Omni's: 2048 smears short consonants)
HOP = N_FFT // 4


def time_stretch(samples: np.ndarray, speed: float) -> np.ndarray:
    """``samples`` (mono float32) played ``speed`` times as fast at the same pitch."""
    if speed == 1.0 or len(samples) == 0:
        return samples
    import torch

    wave = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    window = torch.hann_window(N_FFT)
    if len(wave) <= N_FFT // 2:  # too short for the window's reflection padding
        wave = torch.nn.functional.pad(wave, (0, N_FFT // 2 + 1 - len(wave)))
    spec = torch.stft(wave, N_FFT, HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)  # fmt: skip
    stretched = _phase_vocoder(spec, speed)
    length = int(len(samples) / speed)
    out = torch.istft(stretched, N_FFT, HOP, window=window, center=True, length=length)
    return out.numpy().astype(np.float32, copy=False)


def _phase_vocoder(spec: Any, rate: float) -> Any:
    """``spec`` ``[freq, frames]`` resampled in time by ``rate`` (torchaudio's algorithm)."""
    import torch

    freqs = spec.shape[0]
    advance = torch.linspace(0, math.pi * HOP, freqs, dtype=torch.float32)[:, None]
    steps = torch.arange(0, spec.shape[-1], rate, dtype=torch.float32)
    alphas = steps % 1.0
    phase_0 = spec[:, :1].angle()
    padded = torch.nn.functional.pad(spec, (0, 2))
    spec_0 = padded.index_select(-1, steps.long())
    spec_1 = padded.index_select(-1, (steps + 1).long())
    phase = spec_1.angle() - spec_0.angle() - advance
    phase = phase - 2 * math.pi * torch.round(phase / (2 * math.pi)) + advance
    phase = torch.cumsum(torch.cat([phase_0, phase[:, :-1]], dim=-1), -1)
    magnitude = alphas * spec_1.abs() + (1 - alphas) * spec_0.abs()
    return torch.polar(magnitude, phase)
