"""Qwen3-TTS's speaker encoder: a reference clip (24 kHz mono) to the x-vector a cloned voice
puts in the talker's speaker row, equal to the ``qwen-tts`` package's
``extract_speaker_embedding``.

``speaker_mel`` is its log-mel (a reflect-padded 1024-point STFT, hop 256, of the clip on the
CPU in float32, through librosa's Slaney mel bank for 0-12 kHz, transcribed here).
``SpeakerEncoder`` runs the ECAPA-TDNN on it: transformers' ``ECAPA_TimeDelayNet`` (Qwen2.5-Omni
code that the package's ``Qwen3TTSSpeakerEncoder`` copies line for line, parameter names
included), built on ``meta``, adopted into the arena under its tag (the talker stage's
``speaker_encoder``) and loaded from the checkpoint's ``speaker_encoder.*`` tensors. Only the
Base variant has them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.loader import load_into, module_targets, shown
from omnistage.models.meta import parameters_on_meta
from omnistage.models.qwen3_tts.config import read_config

PART = "speaker_encoder."
# extract_speaker_embedding's mel_spectrogram arguments (fixed there, not read from a config)
SAMPLE_RATE = 24000
N_FFT = 1024
HOP = 256
WINDOW = 1024
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0
_PAD = (N_FFT - HOP) // 2  # reflect padding on each side of the clip
_BOOKKEEPING = ("model_type", "transformers_version")  # what a config's save adds
_NAMES_HINT = " (names are 'speaker_encoder.<tensor>', as Qwen3TTSForConditionalGeneration saves)"


@functools.cache
def mel_bank() -> torch.Tensor:
    """``librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)`` (Slaney
    mel scale and norm, float32), in librosa's order of operations: each triangle is rounded to
    float32 before the float64 norm multiplies it. ``[n_mels, n_fft // 2 + 1]``."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0

    def hz_to_mel(hz: float) -> float:
        return hz / f_sp if hz < min_log_hz else min_log_mel + np.log(hz / min_log_hz) / logstep

    mels = np.linspace(hz_to_mel(FMIN), hz_to_mel(FMAX), N_MELS + 2)
    mel_f = f_sp * mels
    log_t = mels >= min_log_mel
    mel_f[log_t] = min_log_hz * np.exp(logstep * (mels[log_t] - min_log_mel))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, np.fft.rfftfreq(n=N_FFT, d=1.0 / SAMPLE_RATE))
    weights = np.zeros((N_MELS, N_FFT // 2 + 1), dtype=np.float32)
    for i in range(N_MELS):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : N_MELS + 2] - mel_f[:N_MELS]))[:, np.newaxis]
    return torch.from_numpy(weights)


def speaker_mel(samples: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The log-mel of a 24 kHz mono clip as the encoder takes it: ``[1, frames, 128]`` float32
    on the CPU (``frames = len // 256``), the reference's ``mel_spectrogram(...)
    .transpose(1, 2)`` bit for bit. The clip is taken as float32 on the CPU, as the reference
    takes it (``ValueError`` unless 1-D and longer than 384 samples)."""
    if isinstance(samples, torch.Tensor):
        clip = samples.detach().to("cpu", torch.float32)
    else:
        clip = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    if clip.dim() != 1 or clip.shape[0] <= _PAD:
        raise ValueError(
            f"a speaker clip is 1-D samples, more than {_PAD}; got shape {tuple(clip.shape)}"
        )
    y = nn.functional.pad(clip.unsqueeze(0).unsqueeze(1), (_PAD, _PAD), mode="reflect")
    spec = torch.stft(
        y.squeeze(1),
        N_FFT,
        hop_length=HOP,
        win_length=WINDOW,
        window=torch.hann_window(WINDOW),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.log(torch.clamp(torch.matmul(mel_bank(), spec), min=1e-5))
    return mel.transpose(1, 2)


# -- the encoder ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """``config.json``'s ``speaker_encoder_config`` (the reference's
    ``Qwen3TTSSpeakerEncoderConfig``, its defaults where a key is left out); it is also the
    config ``ECAPA_TimeDelayNet`` reads."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    @property
    def min_samples(self) -> int:
        """The shortest clip the encoder takes: its reflect-padded convolutions need more
        frames than they pad on the right."""
        pairs = zip(self.enc_kernel_sizes, self.enc_dilations, strict=True)
        spans = [d * (k - 1) for k, d in pairs]
        pads = [span - span // 2 for span in spans]
        return (max(pads) + 1) * HOP


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def encoder_config(raw: dict[str, Any], where: str) -> SpeakerEncoderConfig:
    """The ``speaker_encoder_config`` section, checked (``CheckpointError`` naming the key)."""
    section = raw.get("speaker_encoder_config")
    section = {} if section is None else section  # as the reference: its defaults
    if not isinstance(section, dict):
        raise CheckpointError(f"{where}: speaker_encoder_config must be an object")
    where = f"{where}: speaker_encoder_config"
    known = {f.name for f in fields(SpeakerEncoderConfig)}
    unknown = sorted(k for k in section if k not in known and k not in _BOOKKEEPING)
    if unknown:
        raise CheckpointError(f"{where} has keys the speaker encoder does not: {unknown}")
    values: dict[str, Any] = {}
    for key in sorted(known & set(section)):
        value = section[key]
        if isinstance(SpeakerEncoderConfig.__dataclass_fields__[key].default, tuple):
            if not isinstance(value, list) or not all(_positive(v) for v in value):
                raise CheckpointError(f"{where}: {key} must be a list of positive integers")
            value = tuple(value)
        elif not _positive(value):
            raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r}")
        values[key] = value
    config = SpeakerEncoderConfig(**values)
    channels, scale = config.enc_channels, config.enc_res2net_scale
    for key, value, want in [
        ("mel_dim", config.mel_dim, N_MELS),  # the reference's mel has 128 bins, whatever this says
        ("sample_rate", config.sample_rate, SAMPLE_RATE),  # extract_speaker_embedding asserts it
        ("enc_kernel_sizes", len(config.enc_kernel_sizes), len(channels)),
        ("enc_dilations", len(config.enc_dilations), len(channels)),
    ]:
        if value != want:
            raise CheckpointError(f"{where}: {key} must be {want} here, got {value!r}")
    middle = channels[1:-1]
    if (
        not middle
        or any(c != channels[0] or c % scale for c in middle)
        or channels[-1] != sum(middle)
    ):
        raise CheckpointError(
            f"{where}: enc_channels {list(channels)} make no ECAPA-TDNN with enc_res2net_scale "
            f"{scale} (equal blocks, each divisible by the scale, then their sum)"
        )
    return config


def build_empty(config: SpeakerEncoderConfig, dtype: torch.dtype) -> nn.Module:
    """transformers' ``ECAPA_TimeDelayNet(config)`` with parameters on ``meta``, in eval mode."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import ECAPA_TimeDelayNet

    with parameters_on_meta():
        module = ECAPA_TimeDelayNet(config)  # type: ignore[arg-type]  # reads its enc_* fields
    module.to(dtype=dtype)
    module.eval()
    module.requires_grad_(False)
    return module


class SpeakerEncoder:
    """One Base checkpoint's speaker encoder in ``arena`` (its weights in ``dtype``: the
    reference runs the encoder in its model's dtype, the mel cast to it)."""

    def __init__(
        self,
        config: SpeakerEncoderConfig,
        arena: Arena,
        *,
        dtype: torch.dtype = torch.float32,
        tag: str = "weights",
    ) -> None:
        self.config = config
        self.device = arena.device
        self.dtype = dtype
        self.tag = tag
        self.module = build_empty(config, dtype)
        self.weight_bytes = arena.adopt(self.module, tag)

    @classmethod
    def from_folder(
        cls, folder: str | Path, arena: Arena, *, dtype: torch.dtype = torch.float32
    ) -> SpeakerEncoder:
        """The encoder of a checkpoint folder, loaded (``CheckpointError`` if the folder is
        not a Base checkpoint, its config does not make an encoder or its tensors do not fit)."""
        folder = Path(folder)
        settings = read_config(folder)
        if settings.variant != "base":
            raise CheckpointError(
                f"{shown(folder)} is a {settings.variant} checkpoint: cloning a voice needs the "
                "Base variant (only it has a speaker encoder)"
            )
        where = str(folder / "config.json")
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:  # read_config has just read it
            raise CheckpointError(f"{where} cannot be read: {exc}") from None
        config = encoder_config(raw, where)
        if config.enc_dim != settings.hidden_size:
            raise CheckpointError(
                f"{where}: speaker_encoder_config enc_dim {config.enc_dim} is not the talker's "
                f"hidden_size {settings.hidden_size} (the x-vector is a talker row)"
            )
        encoder = cls(config, arena, dtype=dtype)
        encoder.load_weights(folder)
        return encoder

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``speaker_encoder.<tensor>``)."""
        return {f"{PART}{key}": t for key, t in module_targets(self.module).items()}

    def load_weights(self, path: str | Path, strict: bool = True) -> int:
        """Copy the ``speaker_encoder.*`` tensors of a checkpoint into the adopted weights
        (every name and shape checked first: ``loader.load_into``); returns the bytes."""
        report = load_into(
            self.weight_targets(),
            path,
            rename=lambda name: name if name.startswith(PART) else None,
            strict=strict,
            hint=_NAMES_HINT,
        )
        return report.num_bytes

    @torch.inference_mode()
    def embed(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The x-vector of a 24 kHz mono clip: ``[enc_dim]`` in the encoder's dtype on its
        device (``ValueError`` for a clip under ``config.min_samples``, 53 ms by default)."""
        count = int(samples.shape[-1]) if samples.ndim == 1 else 0
        if count < self.config.min_samples:
            raise ValueError(
                f"a speaker clip needs at least {self.config.min_samples} samples "
                f"({SAMPLE_RATE} Hz, 1-D); got shape {tuple(samples.shape)}"
            )
        mel = speaker_mel(samples)
        return self.module(mel.to(self.device).to(self.dtype))[0]
