"""The model registry: which family of code serves a checkpoint, found from what the
checkpoint says it is — ``config.json``'s ``architectures`` (then its ``model_type``), or
``model_index.json``'s ``_class_name`` for a diffusers pipeline folder.

A family lives in its own module or package under ``omnistage.models`` and exposes ``FAMILY``:
its config mapping, weight renames and tensor-parallel plan (a decoder), and for a multi-part
checkpoint its parts, the pipeline they form and the hand-offs between them. Adding a family
is one module and one line here. The engine, the stages and the HTTP layer reach model
knowledge only through this registry (and name no model).

Stage-to-stage processors (``input_processor`` in a pipeline) are registered here too, by
name: the generic ones (``omnistage.models.processors``) and a family's.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError


@dataclass(frozen=True)
class FamilyEntry:
    """``name``: what ``ARModelConfig.family`` records; ``home``: the family's module or
    package (it exposes ``FAMILY``); what a checkpoint's ``config.json`` or
    ``model_index.json`` says when it is one of this family's."""

    name: str
    home: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    pipeline_classes: tuple[str, ...] = ()  # diffusers ``_class_name``s


FAMILIES: tuple[FamilyEntry, ...] = (
    FamilyEntry("qwen2", "omnistage.models.qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    FamilyEntry("qwen3", "omnistage.models.qwen3", ("Qwen3ForCausalLM",), ("qwen3",)),
    FamilyEntry(
        "qwen3_moe", "omnistage.models.qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",)
    ),
    FamilyEntry("llama", "omnistage.models.llama", ("LlamaForCausalLM",), ("llama",)),
    FamilyEntry(
        "qwen2_5_omni",
        "omnistage.models.qwen2_5_omni",
        ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"),
        ("qwen2_5_omni",),
    ),
    FamilyEntry(
        "qwen3_omni",
        "omnistage.models.qwen3_omni",
        ("Qwen3OmniMoeForConditionalGeneration",),
        ("qwen3_omni_moe",),
    ),
    FamilyEntry(
        "pixart",
        "omnistage.models.diffusion.pixart",
        pipeline_classes=("PixArtAlphaPipeline", "PixArtSigmaPipeline"),
    ),
    FamilyEntry("flux", "omnistage.models.diffusion.flux", pipeline_classes=("FluxPipeline",)),
    FamilyEntry(
        "sd3", "omnistage.models.diffusion.sd3", pipeline_classes=("StableDiffusion3Pipeline",)
    ),
    FamilyEntry(
        "qwen_image",
        "omnistage.models.diffusion.qwen_image",
        pipeline_classes=("QwenImagePipeline",),
    ),
    FamilyEntry("wan", "omnistage.models.diffusion.wan", pipeline_classes=("WanPipeline",)),
)

PROCESSORS: dict[str, str] = {
    "thinker_hidden_to_image_cond": "omnistage.models.processors:HIDDEN_TO_CONDITIONING",
    "text_to_image_prompt": "omnistage.models.processors:TEXT_TO_PROMPT",
    "thinker_to_talker": "omnistage.models.qwen2_5_omni.processors:THINKER_TO_TALKER",
    "talker_to_code2wav": "omnistage.models.qwen2_5_omni.processors:TALKER_TO_CODE2WAV",
    "qwen3_thinker_to_talker": "omnistage.models.qwen3_omni.processors:THINKER_TO_TALKER",
    "qwen3_talker_to_code2wav": "omnistage.models.qwen3_omni.processors:TALKER_TO_CODE2WAV",
}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def entry(name: str) -> FamilyEntry:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise CheckpointError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")


def family(name: str) -> Any:
    """The ``FAMILY`` object of the family registered as ``name``."""
    return _load(f"{entry(name).home}:FAMILY")


def supported() -> list[str]:
    """What a checkpoint may say it is, for error messages."""
    return sorted(
        {a for f in FAMILIES for a in (*f.architectures, *f.pipeline_classes)}
        | {t for f in FAMILIES for t in f.model_types}
    )


def find(raw: dict[str, Any]) -> FamilyEntry | None:
    """The family an HF ``config.json`` (or a ``model_index.json``) belongs to: by its first
    known ``architectures`` entry, else its ``model_type``, else ``_class_name``."""
    architectures = raw.get("architectures") or []
    for name in architectures if isinstance(architectures, list) else []:
        for f in FAMILIES:
            if name in f.architectures:
                return f
    model_type = raw.get("model_type")
    class_name = raw.get("_class_name")
    for f in FAMILIES:
        if model_type in f.model_types or class_name in f.pipeline_classes:
            return f
    return None


def family_of(raw: dict[str, Any], where: object = "the checkpoint") -> Any:
    """The ``FAMILY`` serving a checkpoint (``CheckpointError`` naming the supported ones)."""
    found = find(raw)
    if found is None:
        said = raw.get("architectures") or raw.get("model_type") or raw.get("_class_name")
        raise CheckpointError(
            f"{where}: {said!r} is not a supported model; supported: {supported()}"
        )
    return family(found.name)


def family_of_folder(folder: str | Path) -> Any:
    """The ``FAMILY`` of a checkpoint folder (``config.json`` or ``model_index.json``)."""
    root = Path(folder)
    for name in ("config.json", "model_index.json"):
        file = root / name
        if file.is_file():
            try:
                raw = json.loads(file.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"cannot read {file}: {exc}") from exc
            if isinstance(raw, dict):
                return family_of(raw, file)
    raise CheckpointError(f"{folder} has no config.json or model_index.json")


def processor(name: str) -> Any:
    """The stage-to-stage processor registered as ``name`` (``ValueError`` naming the known
    ones)."""
    try:
        path = PROCESSORS[name]
    except KeyError:
        raise ValueError(f"unknown input_processor {name!r}; known: {sorted(PROCESSORS)}") from None
    return _load(path)


def is_family_module(module: str) -> bool:
    """Whether ``module`` is (part of) a family's home."""
    return any(module == f.home or module.startswith(f.home + ".") for f in FAMILIES)
