"""Qwen2.5-Omni's token2wav loaded into one stage arena: a DiT and a BigVGAN, and the voices.

The modules are transformers' own (``Qwen2_5OmniToken2WavDiTModel``,
``Qwen2_5OmniToken2WavBigVGANModel``), built from ``config.json``'s ``token2wav_config`` with
their parameters on ``meta``, adopted into the arena under tag ``weights`` and filled by the
loader. Always float32, as transformers runs token2wav. Their non-persistent buffers (the
DiT's rotary ``inv_freq``, the BigVGAN's anti-aliasing filters) are derived data that no
checkpoint holds: they are computed for real at construction (``parameters_on_meta`` moves
parameters only) and put on the stage's device. The voices come from ``spk_dict.pt``
(``{voice: {"cond", "ref_mel", "bos_token"}}``, read with ``weights_only``).

Weight names are the checkpoint's own: ``token2wav.code2wav_dit_model.<tensor>`` and
``token2wav.code2wav_bigvgan_model.<tensor>`` (also accepted without the leading
``token2wav.``, as a ``Qwen2_5OmniToken2WavModel`` saves them). A weight source — the
checkpoint folder for a load or a level-2 reload, a safetensors file or folder for
``update_weights`` — is read for those names only: the thinker's and talker's tensors of the
same folder are never mapped to a target, so never read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnistage.memory import Arena
from omnistage.models.loader import CheckpointError, module_targets, shown
from omnistage.models.meta import move_derived_buffers, parameters_on_meta
from omnistage.models.omni_vocoder import VocoderWeights
from omnistage.models.qwen2_5_omni import config as qwen2_5_omni
from omnistage.models.qwen2_5_omni.voices import SPEAKERS_FILE

logger = logging.getLogger(__name__)

PART = "token2wav."
MODULES = ("code2wav_dit_model", "code2wav_bigvgan_model")
DEFAULT_VOICE = "Chelsie"
DEFAULT_SAMPLE_RATE = 24000
_NAMES_HINT = (
    " (names are 'token2wav.code2wav_dit_model.<tensor>' or "
    "'token2wav.code2wav_bigvgan_model.<tensor>')"
)


@dataclass(frozen=True)
class Voice:
    """One speaker of ``spk_dict.pt``, float32 on the stage's device."""

    cond: torch.Tensor  # [1, enc_emb_dim]: the DiT's speaker embedding
    ref_mel: torch.Tensor  # [1, frames, mel_dim]: its reference mel (the ECAPA encoder's input)


def token2wav_configs(raw: dict[str, Any], where: object) -> tuple[Any, Any]:
    """``(dit_config, bigvgan_config)`` of a Qwen2.5-Omni ``config.json``, as transformers
    reads them."""
    from transformers import Qwen2_5OmniToken2WavConfig

    section = raw.get("token2wav_config")
    if not isinstance(section, dict) or not section:
        raise CheckpointError(f"{shown(where)} has no token2wav_config: no speech decoder")
    try:
        config = Qwen2_5OmniToken2WavConfig.from_dict(section)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{shown(where)}: token2wav_config is not valid: {exc}") from exc
    return config.dit_config, config.bigvgan_config


def build_empty(cls: Any, config: Any) -> nn.Module:
    """``cls(config)`` with parameters on ``meta``, float32, sdpa attention (as transformers'
    ``Qwen2_5OmniToken2WavModel`` builds it), in eval mode."""
    with parameters_on_meta():
        module = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module.float()
    module.eval()
    module.requires_grad_(False)
    return module


def load_voices(
    path: Path, enc_emb_dim: int, mel_dim: int, device: torch.device
) -> dict[str, Voice]:
    """The voices of ``spk_dict.pt``, checked against the DiT's sizes."""
    if not path.is_file():
        raise CheckpointError(f"no voices: {shown(path)} is not a file")
    try:
        raw = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # unpickling refused, truncated file, ...
        raise CheckpointError(f"cannot read the voices in {shown(path)}: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{shown(path)} must hold a non-empty mapping of voices")
    voices = {}
    for name, entry in raw.items():
        cond = entry.get("cond") if isinstance(entry, dict) else None
        ref_mel = entry.get("ref_mel") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or not isinstance(cond, torch.Tensor)
            or not isinstance(ref_mel, torch.Tensor)
            or cond.numel() != enc_emb_dim
            or ref_mel.dim() not in (2, 3)
            or ref_mel.shape[-1] != mel_dim
            or ref_mel.numel() == 0
            or (ref_mel.dim() == 3 and ref_mel.shape[0] != 1)
        ):
            raise CheckpointError(
                f"{shown(path)}: voice {name!r} needs 'cond' [1, {enc_emb_dim}] and 'ref_mel' "
                f"[1, frames, {mel_dim}] tensors"
            )
        # transformers: ``.to(device).float().expand(batch, ...)``
        voices[name] = Voice(
            cond=cond.to(device).float().reshape(1, enc_emb_dim),
            ref_mel=ref_mel.to(device).float().reshape(1, -1, mel_dim),
        )
    return voices


class Token2WavPipeline(VocoderWeights):
    """The DiT, the BigVGAN and the voices of one Qwen2.5-Omni checkpoint folder."""

    part = PART
    names_hint = _NAMES_HINT

    def __init__(self, folder: str | Path, arena: Arena, *, load: bool = True) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniToken2WavBigVGANModel,
            Qwen2_5OmniToken2WavDiTModel,
        )

        self.folder = Path(folder)
        self.device = arena.device
        raw = qwen2_5_omni.read_config(self.folder)
        if raw is None:
            raise CheckpointError(
                f"{shown(self.folder)} is not a Qwen2.5-Omni checkpoint "
                f"(config.json with model_type {qwen2_5_omni.MODEL_TYPE!r})"
            )
        dit_config, bigvgan_config = token2wav_configs(raw, self.folder / "config.json")
        self.dit: Any = build_empty(Qwen2_5OmniToken2WavDiTModel, dit_config)
        self.vocoder: Any = build_empty(Qwen2_5OmniToken2WavBigVGANModel, bigvgan_config)
        self.modules: dict[str, nn.Module] = dict(
            zip(MODULES, (self.dit, self.vocoder), strict=True)
        )
        self.weight_bytes = 0
        self._derived: set[str] = set()  # non-persistent buffers: never read from a source
        self._parts = tuple(f"{m}." for m in MODULES)
        for name, module in self.modules.items():
            self.weight_bytes += arena.adopt(module)
            self._derived |= {f"{name}.{key}" for key in move_derived_buffers(module, self.device)}
        self.mel_dim = int(dit_config.mel_dim)
        self.repeats = int(dit_config.repeats)
        self.voices = load_voices(
            self.folder / SPEAKERS_FILE,
            int(dit_config.enc_emb_dim),
            self.mel_dim,
            self.device,
        )
        self.default_voice = (
            DEFAULT_VOICE if DEFAULT_VOICE in self.voices else next(iter(self.voices))
        )
        rate = section_value(raw, "sample_rate")
        self.sample_rate = int(rate) if isinstance(rate, int) and rate > 0 else DEFAULT_SAMPLE_RATE
        if load:  # not for a restart asleep at level 2: released at once, unread
            self.load_weights(self.folder, strict=True)

    @property
    def codebook_size(self) -> int:
        """Codes are in ``[0, codebook_size)``."""
        return int(self.dit.config.num_embeds)

    @property
    def max_codes(self) -> int:
        """The most codes one utterance may have (the DiT's positions over its repeats)."""
        return int(self.dit.config.max_position_embeddings) // self.repeats

    def synthesis(self, codes: list[int], params: Any, seed: int) -> Any:
        """One utterance's step-wise synthesis (``code2wav.Token2WavSynthesis``)."""
        from omnistage.models.qwen2_5_omni.code2wav import Token2WavSynthesis

        return Token2WavSynthesis(self, codes, params, seed)

    def advance_together(self, items: list[Any]) -> None:
        """One step of each synthesis or stream, sharing DiT forwards where shapes match
        (``code2wav.advance_together``)."""
        from omnistage.models.qwen2_5_omni.code2wav import advance_together

        advance_together(items)

    def streaming_synthesis(self, params: Any, seed: int, chunks: Any) -> Any:
        """One utterance spoken chunk by chunk as its codes arrive
        (``streaming.Token2WavStream``; ``chunks``: first_chunk, chunk, left/right context)."""
        from omnistage.models.qwen2_5_omni.streaming import Token2WavStream

        return Token2WavStream(self, params, seed, chunks)

    # -- weights --------------------------------------------------------------------------

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``token2wav.<module>.<tensor>``)."""
        return {
            f"{PART}{name}.{key}": tensor
            for name, module in self.modules.items()
            for key, tensor in module_targets(module).items()
        }


def section_value(raw: dict[str, Any], key: str) -> Any:
    """``key`` of the token2wav section or its BigVGAN part (real checkpoints have neither)."""
    section = raw.get("token2wav_config") or {}
    vocoder = section.get("bigvgan_config") or {}
    return section.get(key, vocoder.get(key) if isinstance(vocoder, dict) else None)
