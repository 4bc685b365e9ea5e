"""The Qwen3-Omni family: one checkpoint folder (``model_type: qwen3_omni_moe``), three parts,
served as thinker → talker → code2wav (``pipeline.yaml``), each stage sleepable on its own.

Its modules: ``config`` (the thinker's config and the special ids), ``weights`` (the
thinker's renames), ``encoders`` (its audio and vision encoders), ``inputs`` and
``rope_index`` (the prompt processor and its 3-D positions), ``talker`` (the MoE talker,
its projections and requests) with ``code_predictor`` (the residual codebooks of each step),
``processors`` (the hand-offs), ``code2wav`` (the causal vocoder), ``tiny`` (random
checkpoints built with transformers' own classes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.family import Rename, build_decoder
from omnistage.models.omni_family import VOCODER_PART, OmniFamily
from omnistage.models.qwen3_omni.config import FAMILY_NAME

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    import torch

    from omnistage.models.decoder import CausalLM
    from omnistage.models.tensor_parallel import TPGroup

__all__ = ["DECODER_PARTS", "FAMILY", "VOCODER_PART", "Qwen3OmniFamily"]

DECODER_PARTS = ("thinker", "talker")


class Qwen3OmniFamily(OmniFamily):
    name = FAMILY_NAME
    label = "Qwen3-Omni"
    package = __name__
    prompt_processor_class = f"{__name__}.inputs:Qwen3OmniPromptProcessor"
    vocoder_class = f"{__name__}.code2wav:Code2WavVocoder"  # its causal decoder

    def decoder_config(self, raw: dict[str, Any], part: str | None = None) -> ARModelConfig:
        part = part or "thinker"
        if part == "thinker":
            from omnistage.models.qwen3_omni.config import thinker_config

            return thinker_config(raw)
        if part == "talker":
            from omnistage.models.qwen3_omni.talker import talker_config

            return talker_config(raw)
        raise CheckpointError(
            f"model_stage: a Qwen3-Omni checkpoint's decoder parts are {list(DECODER_PARTS)}, "
            f"got {part!r}"
        )

    def build_decoder(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> CausalLM:
        """The part's decoder on ``meta``: the thinker's with its audio and vision encoders
        (whole on every tensor-parallel rank), the talker with its code predictor."""
        if config.part == "talker":
            from omnistage.models.qwen3_omni.talker import build_talker

            return build_talker(config, dtype, tp)
        model = build_decoder(config, dtype, tp)
        from omnistage.models.qwen3_omni.encoders import thinker_encoders

        model.encoders.update(thinker_encoders(config.extras, dtype))
        return model

    def rename(self, part: str | None = None) -> Rename:
        if part == "talker":
            from omnistage.models.qwen3_omni.talker import talker_rename

            return talker_rename
        from omnistage.models.qwen3_omni.weights import decoder_rename

        return decoder_rename(part or "thinker")


FAMILY = Qwen3OmniFamily()
