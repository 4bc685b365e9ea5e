"""The Qwen2.5-Omni family: one checkpoint folder, three parts, served as thinker → talker →
code2wav (``pipeline.yaml``), each stage sleepable on its own.

Its modules: ``config`` (the parts' configs), ``weights`` (the decoder parts' renames),
``encoders`` (the thinker's audio and vision encoders), ``inputs`` (the prompt processor:
media placeholders and encoder inputs) and ``rope_index`` (its 3-D positions), ``voices``,
``talker`` (how requests reach the talker), ``processors`` (the hand-offs), ``token2wav`` and
``code2wav`` (the vocoder the code2wav stage runs), ``tiny`` (random checkpoints built with
transformers' own classes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.family import Rename, build_decoder, load_template
from omnistage.models.qwen2_5_omni.config import FAMILY_NAME, decoder_config
from omnistage.models.qwen2_5_omni.weights import decoder_rename

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    import torch

    from omnistage.models.decoder import CausalLM
    from omnistage.models.qwen2_5_omni.inputs import Qwen25OmniPromptProcessor
    from omnistage.models.tensor_parallel import TPGroup


class Qwen25OmniFamily:
    name = FAMILY_NAME

    def decoder_config(self, raw: dict[str, Any], part: str | None = None) -> ARModelConfig:
        return decoder_config(raw, part)

    def build_decoder(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> CausalLM:
        """The part's decoder on ``meta``; the thinker's with its audio and vision encoders
        (whole on every tensor-parallel rank)."""
        model = build_decoder(config, dtype, tp)
        if config.part == "thinker":
            from omnistage.models.qwen2_5_omni.encoders import thinker_encoders

            model.encoders.update(thinker_encoders(config.extras, dtype))
        return model

    def rename(self, part: str | None = None) -> Rename:
        return decoder_rename(part or "thinker")

    def prompt_processor(self, folder: str | Path) -> Qwen25OmniPromptProcessor:
        """The thinker's prompt processor (placeholders, encoder inputs, positions)."""
        from omnistage.models.qwen2_5_omni.inputs import Qwen25OmniPromptProcessor

        return Qwen25OmniPromptProcessor(folder)

    def pipeline(self) -> list[dict[str, Any]]:
        return load_template(__name__, "pipeline.yaml")

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        if config.part == "talker":
            from omnistage.models.qwen2_5_omni.talker import request_setup

            return request_setup(folder)
        return {}

    def vocoder(
        self, folder: str | Path, arena: Any, *, part: str | None = None, load: bool = True
    ) -> Any:
        """The code2wav part: its DiT, BigVGAN and voices in ``arena``."""
        from omnistage.models.qwen2_5_omni.token2wav import Token2WavPipeline

        if part not in (None, VOCODER_PART):
            raise CheckpointError(
                f"model_stage: a Qwen2.5-Omni vocoder stage runs {VOCODER_PART!r}, got {part!r}"
            )
        return Token2WavPipeline(folder, arena, load=load)


VOCODER_PART = "code2wav"
FAMILY = Qwen25OmniFamily()
