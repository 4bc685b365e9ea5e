"""Qwen3-Omni's code2wav loaded into one stage arena: the vocoder the code2wav stage runs.

``Code2WavVocoder`` builds transformers' own ``Qwen3OmniMoeCode2Wav`` from ``config.json``'s
``code2wav_config`` on ``meta``, adopts it into the arena under tag ``weights`` and loads the
checkpoint's ``code2wav.*`` tensors (float32, sdpa attention). Codes arrive flat and
frame-major. A ``Code2WavSynthesis`` decodes one utterance as ``generate`` does,
``chunked_decode(codes, chunk_size=300, left_context_size=25)``, one window (``windows``) per
step, bit for bit; utterances are decoded one at a time, never batched.

See docs/qwen3-omni.md, "Code2wav: the waveform, whole and streamed" (why the windows are part
of the result, and why no batching).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.loader import module_targets, shown
from omnistage.models.meta import move_derived_buffers, parameters_on_meta
from omnistage.models.omni_vocoder import VocoderWeights
from omnistage.models.qwen3_omni.config import MODEL_TYPE, read_config

PART = "code2wav."
# generate's ``code2wav.chunked_decode(talker_codes, chunk_size=300, left_context_size=25)``
CHUNK_FRAMES = 300
LEFT_CONTEXT_FRAMES = 25
SAMPLE_RATE = 24000  # Qwen3-Omni speaks at 24 kHz (1920 samples per 12.5 Hz frame)
DEFAULT_VOICE = "ethan"  # generate's default speaker (the config's names are lower case)
_NAMES_HINT = " (names are 'code2wav.<tensor>', as Qwen3OmniMoeForConditionalGeneration saves)"


def code2wav_config(raw: dict[str, Any], where: object) -> Any:
    """``code2wav_config`` of a Qwen3-Omni ``config.json``, as transformers reads it."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )

    section = raw.get("code2wav_config")
    if not isinstance(section, dict) or not section:
        raise CheckpointError(f"{shown(where)} has no code2wav_config: no speech decoder")
    try:
        config = Qwen3OmniMoeCode2WavConfig(**section)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{shown(where)}: code2wav_config is not valid: {exc}") from exc
    if int(config.num_quantizers) < 1 or int(config.codebook_size) < 1:
        raise CheckpointError(f"{shown(where)}: code2wav_config needs quantizers and a codebook")
    return config


def windows(num_frames: int) -> list[tuple[int, int, int]]:
    """``chunked_decode``'s windows over ``num_frames`` frames: ``(first, start, end)`` — the
    window decodes frames ``[first, end)`` and keeps the samples of ``[start, end)``."""
    spans: list[tuple[int, int, int]] = []
    while (spans[-1][2] if spans else 0) < num_frames:
        spans.append(window(len(spans), num_frames))
    return spans


def window(index: int, num_frames: int | None = None) -> tuple[int, int, int]:
    """Window ``index`` of ``chunked_decode`` (its end cut at ``num_frames`` when given)."""
    start = index * CHUNK_FRAMES
    context = LEFT_CONTEXT_FRAMES if start - LEFT_CONTEXT_FRAMES > 0 else start
    end = start + CHUNK_FRAMES
    return start - context, start, end if num_frames is None else min(end, num_frames)


def codes_tensor(codes: list[int], groups: int, device: torch.device) -> torch.Tensor:
    """Flat frame-major codes as a decoder takes them: ``[1, groups, frames]``."""
    if len(codes) % groups:
        raise ValueError(f"{len(codes)} codes are not whole frames of {groups} codes")
    flat = torch.tensor(codes, dtype=torch.long, device=device)
    return flat.view(-1, groups).t().unsqueeze(0)


# -- the vocoder ----------------------------------------------------------------------------


def build_empty(config: Any) -> nn.Module:
    """``Qwen3OmniMoeCode2Wav(config)`` with parameters on ``meta``, float32, sdpa attention
    (transformers' default), in eval mode."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    with parameters_on_meta():
        module = Qwen3OmniMoeCode2Wav._from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module.float()
    module.eval()
    module.requires_grad_(False)
    return module


def voices_of(raw: dict[str, Any]) -> list[str]:
    """The talker's speakers (``talker_config.speaker_id``), which the code2wav stage accepts
    as a request's voice; the decoder itself has none."""
    speakers = (raw.get("talker_config") or {}).get("speaker_id") or {}
    return sorted(str(name) for name in speakers) or [DEFAULT_VOICE]


class Code2WavVocoder(VocoderWeights):
    """The causal decoder of one Qwen3-Omni checkpoint folder, in ``arena``."""

    part = PART
    names_hint = _NAMES_HINT
    early_first_chunk = True  # a stream honours a request's ``first_chunk``

    def __init__(self, folder: str | Path, arena: Arena, *, load: bool = True) -> None:
        self.folder = Path(folder)
        self.device = arena.device
        raw = read_config(self.folder)
        if raw is None:
            raise CheckpointError(
                f"{shown(self.folder)} is not a Qwen3-Omni checkpoint "
                f"(config.json with model_type {MODEL_TYPE!r})"
            )
        self.config = code2wav_config(raw, self.folder / "config.json")
        self.module: Any = build_empty(self.config)
        self.weight_bytes = arena.adopt(self.module)
        self._derived = move_derived_buffers(self.module, self.device)
        self._parts = tuple(f"{name}." for name, _ in self.module.named_children())
        self.codes_per_frame = int(self.config.num_quantizers)
        self.samples_per_frame = math.prod(  # the module's ``total_upsample``
            int(r) for r in (*self.config.upsample_rates, *self.config.upsampling_ratios)
        )
        self.voices = voices_of(raw)
        self.default_voice = DEFAULT_VOICE if DEFAULT_VOICE in self.voices else self.voices[0]
        self.sample_rate = SAMPLE_RATE
        if load:  # not for a restart asleep at level 2: released at once, unread
            self.load_weights(self.folder, strict=True)

    @property
    def codebook_size(self) -> int:
        """Codes are in ``[0, codebook_size)``, for every quantizer."""
        return int(self.config.codebook_size)

    @property
    def max_codes(self) -> int:
        """The most codes one utterance may have: ``max_position_embeddings`` frames (a cap,
        10.7 minutes of speech in the real model; the windows never reach it)."""
        return int(self.config.max_position_embeddings) * self.codes_per_frame

    def codes_tensor(self, codes: list[int]) -> torch.Tensor:
        return codes_tensor(codes, self.codes_per_frame, self.device)

    @functools.cached_property
    def reach(self) -> Any:
        """What a stream needs to know of the decoder (``code2wav_stream.DecoderReach``)."""
        from omnistage.models.qwen3_omni.code2wav_stream import DecoderReach

        return DecoderReach(self.module, self.samples_per_frame, self.device)

    @staticmethod
    def window(index: int) -> tuple[int, int, int]:
        """``chunked_decode``'s window ``index``: ``(first, start, end)`` (``window``)."""
        return window(index)

    def synthesis(self, codes: list[int], params: Any, seed: int) -> Code2WavSynthesis:
        """One utterance's decode, a window per step (``seed`` is not used: the decoder
        draws no noise)."""
        return Code2WavSynthesis(self, codes, params)

    def streaming_synthesis(self, params: Any, seed: int, chunks: Any) -> Any:
        """One utterance spoken chunk by chunk as its frames arrive
        (``code2wav_stream.Code2WavStream``; ``chunks``: first_chunk and chunk, in frames)."""
        from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream

        return Code2WavStream(self, params, chunks)

    def advance_together(self, items: list[Any]) -> None:
        """One step of each synthesis or stream, one after another (never batched: see the
        module docstring)."""
        for item in items:
            item.advance()

    # -- the decoder, in two halves (``Qwen3OmniMoeCode2Wav.forward``'s own steps) ----------

    @torch.inference_mode()
    def hidden_states(self, codes: torch.Tensor) -> torch.Tensor:
        """The quantizers' mean embedding through the pre-transformer: ``[1, frames, hidden]``."""
        m = self.module
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        return m.pre_transformer(inputs_embeds=hidden).last_hidden_state

    @torch.inference_mode()
    def upsample(self, hidden: torch.Tensor) -> torch.Tensor:
        """The convolutional stack on ``[1, frames, hidden]``: ``[1, 1, samples]`` in [-1, 1]."""
        wav = hidden.permute(0, 2, 1)
        for blocks in self.module.upsample:
            for block in blocks:
                wav = block(wav)
        for block in self.module.decoder:
            wav = block(wav)
        return wav.clamp(min=-1, max=1)

    # -- weights --------------------------------------------------------------------------

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``code2wav.<tensor>``)."""
        return {f"{PART}{key}": t for key, t in module_targets(self.module).items()}


class WindowDecoder(Protocol):
    """What ``Code2WavSynthesis`` decodes with (Qwen3-Omni's vocoder; Qwen3-TTS's too)."""

    module: Any  # codes [1, Q, T] -> [1, 1, T * samples_per_frame]
    samples_per_frame: int
    default_voice: str

    def codes_tensor(self, codes: list[int]) -> torch.Tensor: ...


class Code2WavSynthesis:
    """One utterance decoded as ``chunked_decode`` decodes it: one window per ``advance``
    (``Qwen3OmniMoeCode2Wav.forward`` on the same codes), then ``waveform()``."""

    batch_key = None  # never shares a forward (see the module docstring)

    def __init__(self, vocoder: WindowDecoder, codes: list[int], params: Any) -> None:
        self.vocoder = vocoder
        self.voice = getattr(params, "voice", None) or vocoder.default_voice
        self.codes = vocoder.codes_tensor(list(codes))
        total = int(self.codes.shape[-1])
        spf = vocoder.samples_per_frame
        # Leading context frames (a cloned voice's reference): their samples are cut as
        # generate_voice_clone cuts them, and windows wholly before the cut are not decoded.
        context = min(int(getattr(params, "context_frames", 0) or 0), total)
        self.cut = int(context / max(total, 1) * (total * spf))
        self.windows = [w for w in windows(total) if w[2] * spf > self.cut]
        self._pieces: list[torch.Tensor] = []

    @property
    def is_done(self) -> bool:
        return len(self._pieces) >= len(self.windows)

    @torch.inference_mode()
    def advance(self) -> None:
        if self.is_done:
            return
        first, start, end = self.windows[len(self._pieces)]
        wav = self.vocoder.module(self.codes[..., first:end])
        spf = self.vocoder.samples_per_frame
        keep = (start - first) * spf + max(self.cut - start * spf, 0)
        self._pieces.append(wav[..., keep:])

    def waveform(self) -> torch.Tensor:
        """The samples (1-D float32 on the CPU), as generate returns them."""
        if not self._pieces:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(self._pieces, dim=-1).reshape(-1).float().cpu()
