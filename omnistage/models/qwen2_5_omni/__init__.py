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

from typing import TYPE_CHECKING, Any

from omnistage.models.ar_config import ARModelConfig
from omnistage.models.family import Rename, build_decoder
from omnistage.models.omni_family import VOCODER_PART, OmniFamily
from omnistage.models.qwen2_5_omni.config import FAMILY_NAME, decoder_config
from omnistage.models.qwen2_5_omni.weights import decoder_rename

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    import torch

    from omnistage.models.decoder import CausalLM
    from omnistage.models.tensor_parallel import TPGroup

__all__ = ["FAMILY", "VOCODER_PART", "Qwen25OmniFamily"]


class Qwen25OmniFamily(OmniFamily):
    name = FAMILY_NAME
    label = "Qwen2.5-Omni"
    package = __name__
    prompt_processor_class = f"{__name__}.inputs:Qwen25OmniPromptProcessor"
    vocoder_class = f"{__name__}.token2wav:Token2WavPipeline"  # its DiT, BigVGAN and voices

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


FAMILY = Qwen25OmniFamily()
