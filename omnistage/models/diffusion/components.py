"""Reading a diffusers-format pipeline folder: which component is which, built without weights.

A diffusers folder has ``model_index.json`` mapping each component name to
``[library, class_name]`` (``[null, null]`` when absent) and one sub-folder per component.
Torch components are built from their ``config.json`` with parameters on the ``meta`` device
(nothing allocated, nothing initialised); the engine then adopts them into its arena and the
loader fills them from the component's safetensors. Buffers are created for real because
non-persistent ones (positional tables) are derived data that no checkpoint holds.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnistage.models.loader import CheckpointError
from omnistage.models.meta import parameters_on_meta

MODEL_INDEX = "model_index.json"
# Weight file stems, in the order diffusers and transformers name them.
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
TORCH_LIBRARIES = ("diffusers", "transformers")
# Components that hold no weights even when a torch library provides their class.
NOT_MODULES = ("scheduler", "tokenizer", "feature_extractor", "image_processor", "processor")


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    library: str
    class_name: str

    @property
    def kind(self) -> str:
        """The name without a numeric suffix: pipelines with several text encoders call them
        ``text_encoder``, ``text_encoder_2``, ... and their tokenizers likewise."""
        stem, _, suffix = self.name.rpartition("_")
        return stem if stem and suffix.isdigit() else self.name

    @property
    def is_torch_module(self) -> bool:
        return self.kind not in NOT_MODULES and self.library in TORCH_LIBRARIES


def read_model_index(folder: str | Path) -> dict[str, ComponentSpec]:
    """The present components of a pipeline folder, by name; raises ``CheckpointError``."""
    path = Path(folder) / MODEL_INDEX
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a diffusers pipeline folder: no {MODEL_INDEX}")
    try:
        index = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(index, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(index).__name__}")
    specs = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, class_name = value
        if library is None or class_name is None:
            continue  # an optional component the pipeline was saved without
        specs[name] = ComponentSpec(name, str(library), str(class_name))
    return specs


def component_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files holding a component's weights, ignoring variants (``.fp16``)."""
    folder = Path(folder)
    for stem in WEIGHT_STEMS:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return [folder / name for name in dict.fromkeys(weight_map.values())]
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a safetensors shard index: {exc!r}") from exc
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            return [single]
    raise CheckpointError(
        f"no weights in {folder}: expected diffusion_pytorch_model.safetensors or "
        "model.safetensors (or their .index.json); .bin checkpoints are not supported"
    )


def _library_class(spec: ComponentSpec) -> Any:
    try:
        module = importlib.import_module(spec.library)
        return getattr(module, spec.class_name)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(
            f"component {spec.name!r}: cannot find {spec.library}.{spec.class_name}: {exc}"
        ) from exc


def build_empty_module(folder: str | Path, spec: ComponentSpec, dtype: torch.dtype) -> nn.Module:
    """The component's module from its ``config.json``, parameters on ``meta``, in eval mode."""
    cls = _library_class(spec)
    component_dir = Path(folder) / spec.name
    if not (component_dir / "config.json").is_file():
        raise CheckpointError(f"component {spec.name!r}: no config.json in {component_dir}")
    with parameters_on_meta():
        if spec.library == "diffusers":
            module = cls.from_config(cls.load_config(component_dir))
        else:
            config = cls.config_class.from_pretrained(component_dir)
            module = cls(config)
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        _cast(module, dtype, _kept_in_float32(module, spec, dtype))
    module.eval()
    module.requires_grad_(False)
    return module


def _kept_in_float32(module: nn.Module, spec: ComponentSpec, dtype: torch.dtype) -> list[str]:
    """The module names whose parameters the library keeps in float32 when it loads the class
    in half precision (``_keep_in_fp32_modules``: diffusers for any dtype, transformers for
    float16, and its ``_keep_in_fp32_modules_strict`` for bfloat16 too): the class's forward
    expects them so."""
    if dtype == torch.float32:
        return []
    names = list(getattr(module, "_keep_in_fp32_modules", None) or [])
    if spec.library == "transformers" and dtype != torch.float16:
        names = []
    return names + list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])


def _cast(module: nn.Module, dtype: torch.dtype, kept: list[str]) -> None:
    """``module.to(dtype)``, except the parameters under a ``kept`` name stay float32."""
    if not kept:
        module.to(dtype)
        return
    for prefix, mod in module.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                path = f"{prefix}.{name}".split(".") if prefix else [name]
                wanted = torch.float32 if any(part in kept for part in path) else dtype
                tensor.data = tensor.data.to(wanted)


def load_tokenizer(folder: str | Path, spec: ComponentSpec) -> Any:
    """The tokenizer component, through its ``transformers`` class (local files only)."""
    cls = _library_class(spec)
    return cls.from_pretrained(Path(folder) / spec.name, local_files_only=True)


def load_scheduler_config(folder: str | Path, spec: ComponentSpec) -> dict[str, Any]:
    """The scheduler's saved config (``scheduler_config.json``) as a dict."""
    cls = _library_class(spec)
    return dict(cls.load_config(Path(folder) / spec.name))


def checkpoint_renamer(module: nn.Module, spec: ComponentSpec) -> Any:
    """For a transformers component, a function from a tensor name as saved to the module's
    name for it (transformers 5 saves some models under their older layout, e.g. Qwen2.5-VL's
    ``model.layers.*`` for ``model.language_model.layers.*``, and renames on load); ``None``
    when names are the module's own. Conversions that merge or split tensors are not
    supported (no diffusion pipeline's encoder uses one)."""
    if spec.library != "transformers":
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(module)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    if not renamings:
        return None
    names = dict.fromkeys(module.state_dict())
    prefix = getattr(module, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        return str(rename_source_key(key, renamings, [], prefix, names)[0])

    return rename
