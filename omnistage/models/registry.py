"""The model registry: which family of code serves a checkpoint, found from what the
checkpoint says it is — ``config.json``'s ``architectures`` (then its ``model_type``), or
``model_index.json``'s ``_class_name`` for a diffusers pipeline folder.

A family lives in its own module or package under ``omnistage.models`` and exposes ``FAMILY``:
its config mapping, weight renames and tensor-parallel plan (a decoder), and for a multi-part
checkpoint its parts, the pipeline they form and the hand-offs between them. Adding a family
is one module and one line here. The engine, the stages and the HTTP layer reach model
knowledge only through this registry (and name no model).

Stage-to-stage processors (``input_processor`` in a pipeline): the generic ones are named
here (``omnistage.models.processors``); a family declares its own (``processors``), named
``<family>.<short name>`` in a pipeline. The families' first names, unqualified, still work.

What a family is typed as, and the capability checks: ``omnistage.models.interfaces``.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.errors import CheckpointError
from omnistage.models.interfaces import (
    ARFamily,
    ModelFamily,
    is_ar_family,
    supports_processors,
)

if TYPE_CHECKING:
    from omnistage.models.processors import InputProcessor


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
        "qwen3_tts",
        "omnistage.models.qwen3_tts",
        ("Qwen3TTSForConditionalGeneration",),
        ("qwen3_tts",),
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
}
# Names pipelines used before the families declared their processors.
PROCESSOR_ALIASES: dict[str, str] = {
    "thinker_to_talker": "qwen2_5_omni.thinker_to_talker",
    "talker_to_code2wav": "qwen2_5_omni.talker_to_code2wav",
    "qwen3_thinker_to_talker": "qwen3_omni.thinker_to_talker",
    "qwen3_talker_to_code2wav": "qwen3_omni.talker_to_code2wav",
}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def entry(name: str) -> FamilyEntry:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise CheckpointError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")


def family(name: str) -> ModelFamily:
    """The ``FAMILY`` object of the family registered as ``name``."""
    found = _load(f"{entry(name).home}:FAMILY")
    if not isinstance(found, ModelFamily):
        raise CheckpointError(f"{entry(name).home}.FAMILY is not a model family")
    return found


def ar_family(name: str) -> ARFamily:
    """The family registered as ``name``, which AR stages serve (``CheckpointError`` if not)."""
    return as_ar(family(name))


def as_ar(found: ModelFamily, where: object = "the checkpoint") -> ARFamily:
    """``found`` as a family AR stages serve (``CheckpointError`` if it is not one)."""
    if not is_ar_family(found):
        raise CheckpointError(f"{where}: a {found.name} model is not served by an AR stage")
    return found


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


def family_of(raw: dict[str, Any], where: object = "the checkpoint") -> ModelFamily:
    """The ``FAMILY`` serving a checkpoint (``CheckpointError`` naming the supported ones)."""
    found = find(raw)
    if found is None:
        said = raw.get("architectures") or raw.get("model_type") or raw.get("_class_name")
        raise CheckpointError(
            f"{where}: {said!r} is not a supported model; supported: {supported()}"
        )
    return family(found.name)


def family_of_folder(folder: str | Path) -> ModelFamily:
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


def _family_processors() -> dict[str, str]:
    """Every family's own processors, by their qualified names."""
    found = {}
    for f in FAMILIES:
        declared = family(f.name)
        if supports_processors(declared):
            found.update({f"{f.name}.{short}": path for short, path in declared.processors.items()})
    return found


@functools.cache  # asked per request and hand-off; a name always means the same processor
def processor(name: str) -> InputProcessor:
    """The stage-to-stage processor named ``name``: a generic one, a family's
    (``<family>.<short name>``) or an older name of one (``ValueError`` naming the known
    ones)."""
    name = PROCESSOR_ALIASES.get(name, name)
    path = PROCESSORS.get(name)
    family_name, dot, short = name.partition(".")
    if path is None and dot and any(f.name == family_name for f in FAMILIES):
        declared = family(family_name)
        if supports_processors(declared):
            path = declared.processors.get(short)
    if path is None:
        known = sorted({*PROCESSORS, *PROCESSOR_ALIASES, *_family_processors()})
        raise ValueError(f"unknown input_processor {name!r}; known: {known}")
    found: InputProcessor = _load(path)
    return found


def is_family_module(module: str) -> bool:
    """Whether ``module`` is (part of) a family's home."""
    return any(module == f.home or module.startswith(f.home + ".") for f in FAMILIES)
