"""``DecoderFamily``: what the registry needs from a family whose checkpoint is one decoder
served as one AR stage — its config mapping (``layout``: what the family knows of its layers
that ``config.json`` does not say), its tensor-parallel plan, its weight renames, the
pipeline it forms. A multi-part family (``omnistage.models.qwen2_5_omni``) answers the same
questions per part, and more (voices, vocoder, hand-offs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.interfaces import ARFamily, Rename
from omnistage.models.tp_plan import DENSE_PLAN, TPPlan

if TYPE_CHECKING:  # the family is read before any model code loads (no torch at import)
    import torch

    from omnistage.models.decoder import CausalLM
    from omnistage.models.tensor_parallel import TPGroup

__all__ = ["DecoderFamily", "Rename", "build_decoder", "load_template", "skip_derived"]


def skip_derived(name: str) -> str | None:
    """A decoder checkpoint's names are the module's; rotary tables some carry are skipped."""
    return None if name.endswith("rotary_emb.inv_freq") else name


def build_decoder(config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None) -> CausalLM:
    from omnistage.models.decoder import CausalLM
    from omnistage.models.tensor_parallel import SINGLE

    return CausalLM.on_meta(config, dtype, tp or SINGLE)


def load_template(package: str, name: str) -> list[dict[str, Any]]:
    """A family's pipeline template: its stages (without ``model``) from a YAML resource."""
    data = yaml.safe_load(resources.files(package).joinpath(name).read_text())
    return [dict(stage) for stage in data["stages"]]


@dataclass(frozen=True)
class DecoderFamily(ARFamily):
    name: str
    layout: Callable[[dict[str, Any]], dict[str, Any]]
    tp_plan: TPPlan = DENSE_PLAN

    def decoder_config(self, raw: dict[str, Any], part: str | None = None) -> ARModelConfig:
        if part is not None:
            raise CheckpointError(
                f"model_stage {part!r} names a part of a multi-part checkpoint; this one is a "
                f"single {self.name} model"
            )
        return ARModelConfig.from_hf(
            raw, family=self.name, tp_plan=self.tp_plan, **self.layout(raw)
        )

    def build_decoder(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> CausalLM:
        """The decoder on ``meta`` (adopt it into an arena, then load)."""
        return build_decoder(config, dtype, tp)

    def rename(self, part: str | None = None) -> Rename:
        return skip_derived

    def pipeline(self) -> list[dict[str, Any]]:
        return load_template("omnistage.models", "decoder.yaml")

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        """What a stage of this family asks of requests beyond its kind's defaults (none)."""
        return {}
