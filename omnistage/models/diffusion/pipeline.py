"""A diffusers-format pipeline folder loaded into one stage arena, whatever its family.

``LoadedPipeline`` builds every torch component of the folder on ``meta``, adopts it into the
arena (the weights tag), moves its non-persistent buffers to the arena's device and fills the
weights with ``load_weights``. It also reads the scheduler config and the tokenizers. It knows
no model: which components a pipeline needs, and what its scheduler config may say, are the
family's to check (``omnistage.models.diffusion.family``).

Weight sources for ``load_weights`` (the first load, a level-2 reload, ``update_weights``)
follow one of two conventions: a folder in the same diffusers layout (each component from its
sub-folder), or a single ``.safetensors`` file whose tensor names are prefixed by component
(``transformer.transformer_blocks.0.attn1.to_q.weight``, ``vae.decoder.conv_in.weight``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnistage.memory import Arena
from omnistage.models.diffusion.components import (
    MODEL_INDEX,
    ComponentSpec,
    build_empty_module,
    checkpoint_renamer,
    component_weight_files,
    load_scheduler_config,
    load_tokenizer,
    read_model_index,
)
from omnistage.models.loader import (
    CheckpointError,
    CopyPlan,
    SafetensorsFile,
    checkpoint_is_folder,
    module_targets,
    open_files,
    plan_copies,
    require_inside,
    shown,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHTS_TAG = "weights"  # the arena tag of every weight unless components sleep apart
# With ``component_tags``: the arena tag of each kind of component (every text encoder under
# one tag); components of other kinds (an image encoder) sleep with the transformer.
COMPONENT_TAGS = {"text_encoder": "text_encoders", "transformer": "transformer", "vae": "vae"}


class LoadedPipeline:
    """The modules, tokenizers and scheduler config of one pipeline folder, in an arena.

    ``required``: the components the family needs besides ``scheduler`` (which every
    denoising loop needs); a missing one is a ``CheckpointError``. So is a text encoder
    without its tokenizer or the reverse (``text_encoder_2`` goes with ``tokenizer_2``).
    With ``load`` False the weights are adopted but not read (a restart asleep at level 2
    releases them at once; or the family checks the folder before reading them).
    With ``component_tags`` each component is adopted under its kind's tag
    (``COMPONENT_TAGS``: text encoders, transformer, VAE sleep and wake apart), otherwise
    all under ``weights``; ``tags`` maps each component to its tag.
    """

    def __init__(
        self,
        folder: str | Path,
        arena: Arena,
        dtype: str = "float32",
        *,
        required: Iterable[str] = (),
        load: bool = True,
        component_tags: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.device = arena.device
        self.dtype = DTYPES[dtype]
        specs = read_model_index(self.folder)
        for name in ("scheduler", *required):
            if name not in specs:
                raise CheckpointError(f"{self.folder / MODEL_INDEX} has no {name!r} component")
        _check_text_pairs(self.folder, specs)
        self.class_name = _pipeline_class(self.folder)
        self.modules: dict[str, nn.Module] = {
            spec.name: build_empty_module(self.folder, spec, self.dtype)
            for spec in specs.values()
            if spec.is_torch_module
        }
        self.tags: dict[str, str] = {
            name: COMPONENT_TAGS.get(specs[name].kind, COMPONENT_TAGS["transformer"])
            if component_tags
            else WEIGHTS_TAG
            for name in self.modules
        }
        # Saved tensor name -> module tensor name, for the components that need one.
        self._renames = {
            name: rename
            for name, module in self.modules.items()
            if (rename := checkpoint_renamer(module, specs[name])) is not None
        }
        self.weight_bytes = 0
        for name, module in self.modules.items():
            self.weight_bytes += arena.adopt(module, self.tags[name])
            _move_derived_buffers(module, self.device)
        self.scheduler_config = load_scheduler_config(self.folder, specs["scheduler"])
        self.scheduler_class_name = specs["scheduler"].class_name
        self.tokenizers: dict[str, Any] = {
            spec.name: load_tokenizer(self.folder, spec)
            for spec in specs.values()
            if spec.kind == "tokenizer"
        }
        if load:
            self.load_weights(self.folder, strict=True)

    # -- components -----------------------------------------------------------------------

    def module(self, name: str) -> Any:
        """The component ``name`` (typed ``Any``: families read its ``config``)."""
        return self.modules[name]

    def optional_module(self, name: str) -> Any | None:
        return self.modules.get(name)

    @property
    def tokenizer(self) -> Any | None:
        """The first (often only) tokenizer."""
        return self.tokenizers.get("tokenizer")

    # -- weights --------------------------------------------------------------------------

    def weight_targets(self, components: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The live weights by '<component>.<tensor>' name (the single-file update names),
        of ``components`` only when given."""
        chosen = self.modules if components is None else set(components)
        return {
            f"{name}.{key}": tensor
            for name, module in self.modules.items()
            if name in chosen
            for key, tensor in module_targets(module).items()
        }

    def load_weights(
        self,
        path: str | Path,
        strict: bool = True,
        *,
        check_finite: bool = False,
        components: Iterable[str] | None = None,
    ) -> int:
        """Copy a weight source (see the module docstring) into the adopted tensors in place.

        Every name and shape (and with ``check_finite`` every value: NaN, Inf or overflow
        of the weights' dtype is refused) is checked before any byte is copied, so a bad
        source leaves the weights untouched. Unknown tensors always raise
        ``CheckpointError``; missing ones only with ``strict`` (a partial update may cover
        some components or tensors). With ``components`` only theirs are written (the
        others may be asleep): a source's tensors of other components are skipped, and
        ``strict`` asks only for theirs. Returns the bytes copied.
        """
        source = Path(path)
        chosen = list(self.modules) if components is None else list(components)
        targets = self.weight_targets(chosen)
        if checkpoint_is_folder(source):
            files = self._folder_files(source, strict, chosen)
        elif source.suffix == ".safetensors":
            files = [(source, "")]
        else:
            raise CheckpointError(
                f"{shown(source)} is neither a diffusers pipeline folder nor a .safetensors file"
            )
        with open_files(file for file, _ in files) as mapped:
            opened = [(st, prefix) for st, (_, prefix) in zip(mapped, files, strict=True)]
            skipped = tuple(f"{name}." for name in self.modules if name not in chosen)
            return _plan_copies(
                opened, targets, strict, source, check_finite, skipped, self._renamed
            ).run()

    def _renamed(self, name: str) -> str:
        """'<component>.<tensor as saved>' to '<component>.<module's tensor name>'."""
        component, _, key = name.partition(".")
        rename = self._renames.get(component)
        return f"{component}.{rename(key)}" if rename is not None else name

    def _folder_files(
        self, folder: Path, strict: bool, components: list[str]
    ) -> list[tuple[Path, str]]:
        files = []
        try:
            specs = read_model_index(folder)
            for name in components:
                if name not in specs:
                    if strict:
                        raise CheckpointError(f"{folder} has no {name!r} component")
                    continue
                component = folder / name
                files += [
                    (require_inside(component, file), f"{name}.")  # index entries like '../x'
                    for file in component_weight_files(component)
                ]
        except (OSError, RecursionError) as exc:  # a path too long once joined; absurd JSON
            raise CheckpointError(
                f"cannot read the pipeline folder {shown(folder)}: {exc}"
            ) from exc
        return files


def _check_text_pairs(folder: Path, specs: dict[str, ComponentSpec]) -> None:
    for spec in specs.values():
        if spec.kind in ("text_encoder", "tokenizer"):
            other = "tokenizer" if spec.kind == "text_encoder" else "text_encoder"
            if spec.name.replace(spec.kind, other, 1) not in specs:
                raise CheckpointError(f"{folder}: text_encoder and tokenizer come together")


def _pipeline_class(folder: Path) -> str:
    """``model_index.json``'s ``_class_name`` (read_model_index has checked the file)."""
    index = json.loads((folder / MODEL_INDEX).read_text())
    return str(index.get("_class_name", ""))


def _plan_copies(
    opened: list[tuple[SafetensorsFile, str]],
    targets: dict[str, torch.Tensor],
    strict: bool,
    source: Path,
    check_finite: bool = False,
    skipped: tuple[str, ...] = (),
    renamed: Any = lambda name: name,
) -> CopyPlan:
    sources = [
        (renamed(prefix + key), st, key)
        for st, prefix in opened
        for key in st.keys()  # noqa: SIM118 - not a dict
        if not (prefix + key).startswith(skipped)  # an empty tuple skips nothing
    ]
    return plan_copies(
        sources,
        targets,
        source,
        strict=strict,
        check_finite=check_finite,
        hint=" (names are '<component>.<tensor>')",
    )


def _move_derived_buffers(module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers stay outside the arena; put them on the stage's device."""
    for mod in module.modules():
        for name in getattr(mod, "_non_persistent_buffers_set", set()):
            buf = mod._buffers.get(name)
            if buf is not None and buf.device != device:
                mod._buffers[name] = buf.to(device)
