"""A diffusers-format pipeline folder loaded into one stage arena.

Supports the PixArt layout (``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` and our tiny
presets, which use it): ``transformer`` (a ``PixArtTransformer2DModel``-like denoiser taking
``encoder_hidden_states`` + ``encoder_attention_mask``), ``vae`` (``AutoencoderKL``),
``scheduler``, and optionally ``text_encoder`` + ``tokenizer``. Every torch component is
built on ``meta``, adopted into the arena under tag ``weights``, and filled by the loader.

Weight sources for ``load_weights`` (level-2 reload and ``update_weights``) follow one of two
conventions: a folder in the same diffusers layout (each component from its sub-folder), or a
single ``.safetensors`` file whose tensor names are prefixed by component
(``transformer.transformer_blocks.0.attn1.to_q.weight``, ``vae.decoder.conv_in.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnistage.memory import Arena
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
from omnistage.stage.diffusion.components import (
    MODEL_INDEX,
    build_empty_module,
    component_weight_files,
    load_scheduler_config,
    load_tokenizer,
    read_model_index,
)
from omnistage.stage.diffusion.params import PipelineLimits
from omnistage.stage.sleep_control import WEIGHTS

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# diffusers' own max_sequence_length defaults per pipeline class (PixArt-alpha: 120).
_MAX_SEQUENCE_LENGTH = {"PixArtAlphaPipeline": 120}
_DEFAULT_MAX_SEQUENCE_LENGTH = 300


class ImagePipeline:
    """The modules, tokenizer and scheduler config of one pipeline folder."""

    def __init__(
        self, folder: str | Path, arena: Arena, dtype: str = "float32", *, load: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.device = arena.device
        self.dtype = _DTYPES[dtype]
        specs = read_model_index(self.folder)
        for required in ("transformer", "vae", "scheduler"):
            if required not in specs:
                raise CheckpointError(f"{self.folder / MODEL_INDEX} has no {required!r} component")
        if ("text_encoder" in specs) != ("tokenizer" in specs):
            raise CheckpointError(f"{self.folder}: text_encoder and tokenizer come together")
        index = json.loads((self.folder / MODEL_INDEX).read_text())
        self.class_name = str(index.get("_class_name", ""))
        self.modules: dict[str, nn.Module] = {
            spec.name: build_empty_module(self.folder, spec, self.dtype)
            for spec in specs.values()
            if spec.is_torch_module
        }
        self.weight_bytes = 0
        for module in self.modules.values():
            self.weight_bytes += arena.adopt(module, WEIGHTS)
            _move_derived_buffers(module, self.device)
        self.scheduler_config = load_scheduler_config(self.folder, specs["scheduler"])
        self.scheduler_class_name = specs["scheduler"].class_name
        if self.scheduler_config.get("use_dynamic_shifting"):
            raise CheckpointError(
                f"{self.folder}/scheduler: use_dynamic_shifting schedulers need a resolution "
                "dependent 'mu', which this engine does not compute"
            )
        self.tokenizer = (
            load_tokenizer(self.folder, specs["tokenizer"]) if "tokenizer" in specs else None
        )
        if load:  # not for a restart asleep at level 2: released at once, unread
            self.load_weights(self.folder, strict=True)

    # -- components -----------------------------------------------------------------------

    @property
    def transformer(self) -> Any:
        return self.modules["transformer"]

    @property
    def vae(self) -> Any:
        return self.modules["vae"]

    @property
    def text_encoder(self) -> Any | None:
        return self.modules.get("text_encoder")

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.transformer.config.sample_size) * self.vae_scale_factor

    @property
    def limits(self) -> PipelineLimits:
        return PipelineLimits(
            size_multiple=self.vae_scale_factor * int(self.transformer.config.patch_size),
            embedding_dim=int(self.transformer.config.caption_channels),
            has_text_encoder=self.text_encoder is not None,
            max_inference_steps=int(self.scheduler_config.get("num_train_timesteps", 1000)),
        )

    @property
    def default_max_sequence_length(self) -> int:
        default = _MAX_SEQUENCE_LENGTH.get(self.class_name, _DEFAULT_MAX_SEQUENCE_LENGTH)
        limit = getattr(self.tokenizer, "model_max_length", None)
        return min(default, int(limit)) if isinstance(limit, int) and limit > 0 else default

    # -- text -----------------------------------------------------------------------------

    def encode_text(self, text: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings [max_length, dim], mask [max_length])`` as diffusers' PixArt does it:
        lower-case and strip the text (its ``clean_caption=False`` preprocessing), pad to
        ``max_length``, truncate, add special tokens, keep the padded positions."""
        if self.tokenizer is None or self.text_encoder is None:
            raise CheckpointError(f"{self.folder} has no text encoder")
        tokens = self.tokenizer(
            [text.lower().strip()],
            padding="max_length",
            max_length=max_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        return hidden[0].to(self.dtype), mask[0]

    # -- weights --------------------------------------------------------------------------

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        """Copy a weight source (see the module docstring) into the adopted tensors in place.

        Every name and shape (and with ``check_finite`` every value: NaN, Inf or overflow
        of the weights' dtype is refused) is checked before any byte is copied, so a bad
        source leaves the weights untouched. Unknown tensors always raise
        ``CheckpointError``; missing ones only with ``strict`` (a partial update may cover
        some components or tensors). Returns the bytes copied.
        """
        source = Path(path)
        targets = {
            f"{name}.{key}": tensor
            for name, module in self.modules.items()
            for key, tensor in module_targets(module).items()
        }
        if checkpoint_is_folder(source):
            files = self._folder_files(source, strict)
        elif source.suffix == ".safetensors":
            files = [(source, "")]
        else:
            raise CheckpointError(
                f"{shown(source)} is neither a diffusers pipeline folder nor a .safetensors file"
            )
        with open_files(file for file, _ in files) as mapped:
            opened = [(st, prefix) for st, (_, prefix) in zip(mapped, files, strict=True)]
            return self._plan_copies(opened, targets, strict, source, check_finite).run()

    def _folder_files(self, folder: Path, strict: bool) -> list[tuple[Path, str]]:
        files = []
        try:
            specs = read_model_index(folder)
            for name in self.modules:
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

    @staticmethod
    def _plan_copies(
        opened: list[tuple[SafetensorsFile, str]],
        targets: dict[str, torch.Tensor],
        strict: bool,
        source: Path,
        check_finite: bool = False,
    ) -> CopyPlan:
        sources = [
            (prefix + key, st, key)
            for st, prefix in opened
            for key in st.keys()  # noqa: SIM118 - not a dict
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
