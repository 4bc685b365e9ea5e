"""Qwen3-TTS's speech-tokenizer decoder as the code2wav stage runs it (``Qwen3TTSVocoder``):
an utterance's codes, flat and frame-major, decoded window by window as the reference's
``decode`` does them (``synthesis``), or chunk by chunk while the talker still speaks
(``streaming_synthesis``: Qwen3-Omni's ``Code2WavStream``, the joined chunks the whole
decode's samples bit for bit on the CPU). Its voices are the checkpoint's speakers.

Streamed, the decoder is cut where Qwen3-Omni's is: ``hidden_states`` (the split RVQ, the
``pre_conv`` and the transformer: run over the window from its first frame) and ``upsample``
(the convolutional stack, started ``context_samples`` before the first sample handed out).
Its transposed convs trim only their right end, so a decode of n frames makes all of its
``n * 1920`` samples (``samples_lost`` is 0) and a chunk needs no frame after its own. A
clone in context streams too: its reference frames arrive first, their samples cut. See
docs/tts.md, *Streamed speech*, and docs/qwen3-omni.md, *Code2wav* (why each rule)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from omnistage.memory import Arena
from omnistage.models.qwen3_omni.code2wav import window
from omnistage.models.qwen3_tts.code2wav import Qwen3TTSDecoder

DEFAULT_VOICE = "default"  # the voice of a checkpoint without named speakers


class Qwen3TTSVocoder(Qwen3TTSDecoder):
    """The decoder of a Qwen3-TTS checkpoint as the code2wav stage runs it: an utterance's
    codes (flat, frame-major) decoded as the reference's ``decode`` does them, one window of
    ``chunked_decode`` per step (Qwen3-Omni's ``Code2WavSynthesis``: the same windows), or
    streamed (Qwen3-Omni's ``Code2WavStream``). Its voices are the checkpoint's speakers (the
    talker speaks in them; the decoder has none)."""

    early_first_chunk = True  # a stream honours a request's ``first_chunk``

    def __init__(self, folder: str | Path, arena: Arena, *, load: bool = True) -> None:
        super().__init__(folder, arena, load=load)
        from omnistage.models.qwen3_tts.config import is_tts_checkpoint, read_config

        speakers = sorted(read_config(folder).speakers) if is_tts_checkpoint(folder) else []
        self.voices = speakers or [DEFAULT_VOICE]
        self.default_voice = self.voices[0]

    @property
    def max_codes(self) -> int:
        """The most codes one utterance may have (``max_position_embeddings`` frames)."""
        return int(self.config.max_position_embeddings) * self.codes_per_frame

    def codes_tensor(self, codes: list[int]) -> torch.Tensor:
        from omnistage.models.qwen3_omni.code2wav import codes_tensor

        return codes_tensor(codes, self.codes_per_frame, self.device)

    @functools.cached_property
    def reach(self) -> Any:
        """What a stream needs to know of the decoder (``code2wav_stream.DecoderReach``),
        with which rows of an unfinished window its transformer has made final (probed on
        the CPU, ``latents_settle``; elsewhere no decode is the whole one's bit for bit)."""
        from omnistage.models.qwen3_omni.code2wav import CHUNK_FRAMES, LEFT_CONTEXT_FRAMES
        from omnistage.models.qwen3_omni.code2wav_stream import DecoderReach, latents_settle

        settle = None
        if self.device.type == "cpu":
            window = CHUNK_FRAMES + LEFT_CONTEXT_FRAMES
            settle = latents_settle(self.module, self.device, window)
        return DecoderReach(self.module, self.samples_per_frame, self.device, settle=settle)

    @staticmethod
    def window(index: int) -> tuple[int, int, int]:
        """``chunked_decode``'s window ``index``: ``(first, start, end)``."""
        return window(index)

    def synthesis(self, codes: list[int], params: Any, seed: int) -> Any:
        """One utterance's decode, a window per step (``seed`` unused: no noise is drawn)."""
        from omnistage.models.qwen3_omni.code2wav import Code2WavSynthesis

        return Code2WavSynthesis(self, codes, params)

    def streaming_synthesis(self, params: Any, seed: int, chunks: Any) -> Any:
        """One utterance spoken chunk by chunk as its frames arrive (``chunks``: first_chunk
        and chunk, in frames; ``seed`` unused). A clone in context's reference frames come
        first (``params.context_frames``), their samples cut as ``synthesis`` cuts them."""
        from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream

        return Code2WavStream(self, params, chunks)

    def advance_together(self, items: list[Any]) -> None:
        """One step of each synthesis or stream, one after another (never batched)."""
        for item in items:
            item.advance()

    # -- the decoder in two halves (``SpeechDecoder.forward``'s own), for a stream ---------

    @torch.inference_mode()
    def hidden_states(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[1, Q, T]`` to the transformer's latents ``[1, T, latent_dim]``."""
        return self.module.latents(codes)

    @torch.inference_mode()
    def upsample(self, hidden: torch.Tensor) -> torch.Tensor:
        """The convolutional stack on ``[1, T, latent_dim]``: ``[1, 1, samples]`` in [-1, 1]."""
        return self.module.upsample_latents(hidden)
