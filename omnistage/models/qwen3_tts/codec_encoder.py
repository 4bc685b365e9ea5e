"""Qwen3-TTS's speech-tokenizer encoder (12 Hz): a 24 kHz clip to codes ``[T, 16]``, a cloned
voice's reference codes (``ref_code``), equal to the ``qwen-tts`` package's tokenizer
``encode``.

The encoder is Mimi's: transformers' own ``MimiModel`` built from ``speech_tokenizer/
config.json``'s ``encoder_config`` without its decoder (as the package's
``Qwen3TTSTokenizerV2Encoder`` drops it), on ``meta``, float32, adopted into the arena under
its own tag and loaded from ``model.safetensors``' ``encoder.*`` tensors. Names as the
published tokenizer has them (Mimi's flat layout: ``encoder.encoder.layers.*``,
``encoder.encoder_transformer.*``, ``encoder.downsample.*``, ``encoder.quantizer.*``); the
nested layout transformers 5 saves (``encoder.encoder.encoder.layers.*``, ...) is read too.
Its transformer attends causally over the whole clip, as the package restores it on
transformers 5 (``restore_mimi_full_attention``: the window is ``max_position_embeddings``).
A clip of ``n`` samples makes ``ceil(n / encode_downsample_rate)`` frames, the first
``encoder_valid_num_quantizers`` codebooks of each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.loader import load_into, module_targets, shown
from omnistage.models.meta import move_derived_buffers, parameters_on_meta

TAG = "codec_encoder"
PART = "encoder."
FOLDER = "speech_tokenizer"
_NAMES_HINT = (
    " (names are 'encoder.<tensor>', as the speech tokenizer's model.safetensors has them)"
)
# module name prefix -> published name prefix (Mimi's flat layout under ``encoder.``)
_PUBLISHED = {
    "encoder.encoder_seanet.": "encoder.encoder.",
    "encoder.encoder_transformer.": "encoder.encoder_transformer.",
    "encoder.downsample.": "encoder.downsample.",
    "quantizer.": "encoder.quantizer.",
}
# transformers 5's nested save -> the published name
_NESTED = {
    "encoder.encoder.encoder.": "encoder.encoder.",
    "encoder.encoder.encoder_transformer.": "encoder.encoder_transformer.",
    "encoder.encoder.downsample.": "encoder.downsample.",
}


def frames_of(num_samples: int, downsample_rate: int) -> int:
    """How many frames the encoder keeps of a clip: ``ceil(n / downsample_rate)``."""
    return -(-int(num_samples) // int(downsample_rate))


def read_settings(folder: str | Path) -> dict[str, Any]:
    """The speech tokenizer's ``config.json`` (of a checkpoint or its ``speech_tokenizer``
    folder), checked to describe an encoder (``CheckpointError`` naming the key)."""
    path = Path(folder)
    path = path / FOLDER if (path / FOLDER / "config.json").is_file() else path
    where = path / "config.json"
    try:
        raw = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the speech tokenizer's {shown(where)}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("encoder_config"), dict):
        raise CheckpointError(f"{shown(where)} has no encoder_config: no speech encoder")
    for key, default in (("encode_downsample_rate", 1920), ("input_sample_rate", 24000)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{shown(where)}: {key} must be a positive integer")
    return raw


def build_empty(encoder_config: dict[str, Any]) -> Any:
    """transformers' ``MimiModel`` without its decoder, parameters on ``meta``, float32, in
    eval mode, its transformer's window the whole clip (see the module docstring)."""
    from transformers import MimiConfig, MimiModel

    try:
        config = MimiConfig(**{k: v for k, v in encoder_config.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"speech tokenizer: encoder_config is not valid: {exc}") from exc
    config._attn_implementation = "sdpa"
    with parameters_on_meta():
        module = MimiModel(config)
    module.decoder = None  # as Qwen3TTSTokenizerV2Encoder: encoding only
    for mod in module.modules():  # the package's restore_mimi_full_attention
        if not type(mod).__module__.startswith("transformers.models.mimi"):
            continue
        sub = getattr(mod, "config", None)
        if sub is not None and hasattr(sub, "sliding_window"):
            sub.sliding_window = sub.max_position_embeddings
            if hasattr(mod, "sliding_window"):
                mod.sliding_window = sub.max_position_embeddings
    module.float()
    module.eval()
    module.requires_grad_(False)
    return module


def published_name(name: str) -> str:
    """A module tensor's name as the published tokenizer saves it."""
    for ours, theirs in _PUBLISHED.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise CheckpointError(f"the speech encoder has an unexpected tensor {name!r}")


def rename(name: str) -> str | None:
    """A source tensor's published name; None for what is not the encoder's."""
    if not name.startswith(PART):
        return None
    for nested, published in _NESTED.items():
        if name.startswith(nested):
            return published + name[len(nested) :]
    return name


class CodecEncoder:
    """One checkpoint's speech encoder in ``arena`` (tag ``tag``)."""

    def __init__(
        self, folder: str | Path, arena: Arena, *, load: bool = True, tag: str = TAG
    ) -> None:
        raw = read_settings(folder)
        self.folder = Path(folder)
        self.device = arena.device
        self.tag = tag
        self.downsample_rate = int(raw.get("encode_downsample_rate", 1920))
        self.sample_rate = int(raw.get("input_sample_rate", 24000))
        self.module: Any = build_empty(raw["encoder_config"])
        self.num_quantizers = int(raw.get("encoder_valid_num_quantizers", 16))
        if not 1 <= self.num_quantizers <= int(self.module.config.num_quantizers):
            raise CheckpointError(
                f"speech tokenizer: encoder_valid_num_quantizers {self.num_quantizers} is not "
                f"in [1, {self.module.config.num_quantizers}]"
            )
        self.weight_bytes = arena.adopt(self.module, tag)
        move_derived_buffers(self.module, self.device)
        self._targets = {published_name(k): t for k, t in module_targets(self.module).items()}
        if load:
            self.load_weights(self.folder)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by published name (``encoder.<tensor>``)."""
        return dict(self._targets)

    def load_weights(self, path: str | Path, strict: bool = True) -> int:
        """Copy the ``encoder.*`` tensors of a checkpoint (its ``speech_tokenizer`` folder, or
        a file) into the adopted weights; returns the bytes."""
        path = Path(path)
        if (path / FOLDER / "config.json").is_file():
            path = path / FOLDER
        report = load_into(self._targets, path, rename=rename, strict=strict, hint=_NAMES_HINT)
        for mod in self.module.modules():  # codebooks cache their entries on first use
            if hasattr(mod, "_embed"):
                mod._embed = None
        return report.num_bytes

    def frames(self, num_samples: int) -> int:
        return frames_of(num_samples, self.downsample_rate)

    @torch.inference_mode()
    def encode(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A 24 kHz mono clip's codes: ``[frames, num_quantizers]`` (long, on the CPU)."""
        if isinstance(samples, torch.Tensor):
            clip = samples.detach().to("cpu", torch.float32)
        else:
            clip = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
        if clip.dim() != 1 or clip.shape[0] < 1:
            raise ValueError(f"a clip is 1-D samples, got shape {tuple(clip.shape)}")
        values = clip.to(self.device)[None, None]
        codes = self.module.encode(values, return_dict=True).audio_codes
        codes = codes[0, : self.num_quantizers, : self.frames(clip.shape[0])]
        return codes.transpose(0, 1).cpu()
