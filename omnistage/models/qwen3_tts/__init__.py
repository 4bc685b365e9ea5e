"""Qwen3-TTS (the 12 Hz tokenizer's checkpoints, ``model_type: qwen3_tts``): a talker with its
code predictor speaks text as frames of 16 codes, and the speech tokenizer's decoder turns them
into a 24 kHz waveform; each part equal to the official ``qwen-tts`` package. ``config`` (the
checkpoint's settings), ``prompt`` (the talker's prompt rows), ``speech`` (a speech request's
prompt), ``talker`` (the talker as an AR stage runs it), ``speaker`` (a cloned voice's
x-vector), ``codec_encoder`` (the speech tokenizer's encoder: a clone's reference codes),
``code2wav`` (the speech tokenizer's decoder) and ``vocoder`` (it, as a code2wav stage runs
it). Served as talker -> code2wav (``pipeline.yaml``), spoken to through
``/v1/audio/speech``; a Base checkpoint clones the voice of a request's ``ref_audio`` (its
talker stage holds the speaker and speech encoders under their own arena tags).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models import interfaces as can
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.family import Rename, load_template
from omnistage.models.omni_family import check_vocoder_part

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    import torch

    from omnistage.models.decoder import CausalLM
    from omnistage.models.interfaces import SpeechInput
    from omnistage.models.tensor_parallel import TPGroup

FAMILY_NAME = "qwen3_tts"
TALKER_PART = "talker"


class Qwen3TTSFamily(can.ARFamily, can.SupportsVocoder, can.SupportsProcessors, can.SupportsSpeech):
    name = FAMILY_NAME
    processors = {"talker_to_code2wav": f"{__name__}.processors:TALKER_TO_CODE2WAV"}

    def pipeline(self) -> list[dict[str, Any]]:
        """Talker -> code2wav (``pipeline.yaml``); requests come through ``speech_prompt``."""
        return load_template(__name__, "pipeline.yaml")

    def speech_prompt(
        self, folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
    ) -> dict[str, Any]:
        from omnistage.models.qwen3_tts.speech import speech_prompt

        return speech_prompt(folder, encode, speech)

    def speech_voices(self, folder: str) -> list[str]:
        from omnistage.models.qwen3_tts.config import served_config

        return sorted(served_config(folder).speakers)

    def decoder_config(self, raw: dict[str, Any], part: str | None = None) -> ARModelConfig:
        if part not in (None, TALKER_PART):
            raise CheckpointError(
                f"model_stage: a Qwen3-TTS checkpoint's decoder part is {TALKER_PART!r}, got {part!r}"
            )
        return _talker().talker_config(raw)

    def build_decoder(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> CausalLM:
        return _talker().build_talker(config, dtype, tp)

    def rename(self, part: str | None = None) -> Rename:
        return _talker().talker_rename

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        from omnistage.models.qwen3_tts.config import read_config

        tts = read_config(folder)
        s = tts.sampling
        greedy = not s["do_sample"]
        defaults = {
            "temperature": 0.0 if greedy else s["temperature"],
            "top_k": s["top_k"],
            "top_p": s["top_p"],
            "repetition_penalty": s["repetition_penalty"],
            "max_tokens": s["max_new_tokens"],
            "min_tokens": 2,  # generate's min_new_tokens
        }
        return {"param_defaults": defaults, "stop_token_ids": [tts.codec.eos]}

    def vocoder(
        self, folder: str | Path, arena: Any, *, part: str | None = None, load: bool = True
    ) -> Any:
        """The speech tokenizer's decoder (``speech_tokenizer/``) in ``arena``."""
        check_vocoder_part("Qwen3-TTS", part)
        from omnistage.models.qwen3_tts.vocoder import Qwen3TTSVocoder

        return Qwen3TTSVocoder(folder, arena, load=load)


def _talker() -> Any:
    """The talker's module, imported when first asked (it loads torch)."""
    from omnistage.models.qwen3_tts import talker

    return talker


FAMILY = Qwen3TTSFamily()
