"""Qwen3-TTS's speech-tokenizer decoder (12 Hz): codes ``[B, 16, T]`` to a 24 kHz waveform.

``SpeechDecoder`` is the reference ``Qwen3TTSTokenizerV2Decoder`` with its parameter names,
composed of transformers' Qwen3-Omni code2wav parts where they compute the same: the
sliding-window transformer (here between an input and an output projection), the ConvNeXt
upsampler, the causal convs and the SnakeBeta decoder blocks (whose transposed convs trim
only their right end: ``T * 1920`` samples, none lost). New: the split residual vector
quantizer that turns codes into latents, and the ``pre_conv``. ``chunked_decode`` decodes
Qwen3-Omni's windows (300 frames, 25 of left context; ``windows``).

``Qwen3TTSDecoder`` reads ``speech_tokenizer/config.json``'s ``decoder_config``, builds the
module on ``meta`` (float32, sdpa attention), adopts it into the arena under tag ``weights``
and loads ``model.safetensors``' ``decoder.*`` tensors (its ``encoder.*`` are not read).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavTransformerModel,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.loader import module_targets, shown
from omnistage.models.meta import move_derived_buffers, parameters_on_meta
from omnistage.models.omni_vocoder import VocoderWeights
from omnistage.models.qwen3_omni.code2wav import windows

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
FOLDER = "speech_tokenizer"  # where a Qwen3-TTS checkpoint keeps its speech tokenizer
PART = "decoder."
SAMPLE_RATE = 24000
_NAMES_HINT = " (names are 'decoder.<tensor>', as Qwen3TTSTokenizerV2Model saves them)"

# ``Qwen3TTSTokenizerV2DecoderConfig``'s defaults; ``codebook_dim`` has none.
_INTS = {
    "codebook_size": 2048,
    "hidden_size": 1024,
    "latent_dim": 1024,
    "codebook_dim": None,
    "max_position_embeddings": 8000,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "sliding_window": 72,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_quantizers": 16,
    "decoder_dim": 1536,
}
_FLOATS = {
    "rope_theta": 10000.0,
    "layer_scale_initial_scale": 0.01,
    "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0,
}
_RATES = {"upsample_rates": (8, 5, 4, 3), "upsampling_ratios": (2, 2)}


# -- the config -----------------------------------------------------------------------------


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a speech-tokenizer folder, checked to be the 12 Hz tokenizer's."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"cannot read the speech tokenizer's {shown(path)}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{shown(path)}: model_type is not {MODEL_TYPE!r}")
    return raw


def _int(section: dict[str, Any], key: str, default: int | None, where: str, least: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise CheckpointError(f"{where}: decoder_config.{key} must be an int >= {least}")
    return value


def _float(section: dict[str, Any], key: str, default: float, where: str) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise CheckpointError(f"{where}: decoder_config.{key} must be a finite number >= 0")
    return float(value)


def decoder_config(raw: dict[str, Any], where: object) -> Qwen3OmniMoeCode2WavConfig:
    """``decoder_config`` as a Qwen3-Omni code2wav config (the fields they share, plus
    ``latent_dim``, ``codebook_dim`` and ``head_dim``), each key checked."""
    at = shown(where)
    section = raw.get("decoder_config")
    if not isinstance(section, dict):
        raise CheckpointError(f"{at} has no decoder_config")
    ints = {
        key: _int(section, key, default, at, 2 if key == "num_quantizers" else 1)
        for key, default in _INTS.items()
    }
    floats = {key: _float(section, key, default, at) for key, default in _FLOATS.items()}
    rates: dict[str, list[int]] = {}
    for key, default in _RATES.items():
        value = section.get(key, default)
        if not isinstance(value, list | tuple) or not value:
            raise CheckpointError(f"{at}: decoder_config.{key} must be a list of ints")
        rates[key] = [_int({key: r}, key, None, at, 1) for r in value]
    extra: dict[str, Any] = {}
    if section.get("head_dim") is not None:
        extra["head_dim"] = _int(section, "head_dim", None, at, 1)
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise CheckpointError(f"{at}: decoder_config.num_key_value_heads must divide the heads")
    if ints["decoder_dim"] >> len(rates["upsample_rates"]) < 1:
        raise CheckpointError(f"{at}: decoder_config.decoder_dim is too small to halve per rate")
    if section.get("rope_scaling") is not None:
        raise CheckpointError(f"{at}: decoder_config.rope_scaling is not supported (default RoPE)")
    if not isinstance(section.get("attention_bias", False), bool):
        raise CheckpointError(f"{at}: decoder_config.attention_bias must be a bool")
    hidden_act = section.get("hidden_act", "silu")
    if not isinstance(hidden_act, str) or hidden_act not in ACT2FN:
        raise CheckpointError(f"{at}: decoder_config.hidden_act {shown(hidden_act)} is unknown")
    fields: dict[str, Any] = {**ints, **floats, **rates, **extra}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    fields["attention_bias"] = section.get("attention_bias", False)
    try:
        return Qwen3OmniMoeCode2WavConfig(**fields, hidden_act=hidden_act)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{at}: decoder_config is not valid: {exc}") from exc


# -- the module -----------------------------------------------------------------------------


class EuclideanCodebook(nn.Module):
    """One codebook: entry ``i`` is ``embedding_sum[i] / cluster_usage[i]``."""

    def __init__(self, dim: int, codebook_size: int, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` codes to ``[B, T, dim]``."""
        embedding = self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]
        return F.embedding(codes, embedding)


class VectorQuantization(nn.Module):
    """A quantizer's codebook (its ``project_out`` is the identity: the codebook has the
    quantizer's width)."""

    def __init__(self, dim: int, codebook_size: int) -> None:
        super().__init__()
        self._codebook = EuclideanCodebook(dim, codebook_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` codes to ``[B, dim, T]``."""
        return self._codebook.decode(codes).transpose(1, 2)


class ResidualVectorQuantization(nn.Module):
    def __init__(self, num_quantizers: int, dim: int, codebook_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VectorQuantization(dim, codebook_size) for _ in range(num_quantizers)
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[K, B, T]`` codes to the sum of their entries, ``[B, dim, T]`` (in order)."""
        quantized = torch.zeros([1], device=codes.device)[0]
        layer: VectorQuantization
        for layer, layer_codes in zip(self.layers, codes, strict=False):  # type: ignore[assignment]
            quantized = quantized + layer.decode(layer_codes)
        return quantized


class ResidualVectorQuantizer(nn.Module):
    """Residual quantizers of width ``dim`` between 1x1 convs from and to ``io_dim``
    (``input_proj`` is the encoder's: decoding never runs it)."""

    def __init__(self, num_quantizers: int, dim: int, io_dim: int, codebook_size: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = ResidualVectorQuantization(num_quantizers, dim, codebook_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, K, T]`` codes to ``[B, io_dim, T]``."""
        return self.output_proj(self.vq.decode(codes.transpose(0, 1)))


class SplitResidualVectorQuantizer(nn.Module):
    """The first (semantic) quantizer and the rest, each with its own projections."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, io_dim, size = config.codebook_dim // 2, config.codebook_dim, config.codebook_size
        self.rvq_first = ResidualVectorQuantizer(1, dim, io_dim, size)
        self.rvq_rest = ResidualVectorQuantizer(config.num_quantizers - 1, dim, io_dim, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, K, T]`` codes to latents ``[B, codebook_dim, T]``."""
        quantized = self.rvq_first.decode(codes[:, :1])
        if codes.shape[1] > 1:
            quantized += self.rvq_rest.decode(codes[:, 1:])
        return quantized


class LatentTransformer(Qwen3OmniMoeCode2WavTransformerModel):
    """Qwen3-Omni's code2wav transformer between projections from and to ``latent_dim``."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__(config)
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)

    def latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, T, latent_dim]`` through the transformer: ``[B, T, latent_dim]``."""
        hidden = super().forward(inputs_embeds=self.input_proj(latents), use_cache=False)
        return self.output_proj(hidden.last_hidden_state)


class DecoderBlock(Qwen3OmniMoeCode2WavDecoderBlock):
    """Qwen3-Omni's decoder block whose transposed conv trims ``kernel - stride`` samples at
    its right end only (Qwen3-Omni's trims both ends): ``rate`` samples per input sample."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        upsample = self.block[1]
        assert isinstance(upsample, Qwen3OmniMoeCausalTransConvNet)
        upsample.left_pad = 0  # right_pad stays kernel - stride


class SpeechDecoder(nn.Module):
    """``Qwen3TTSTokenizerV2Decoder``: the reference's parameters, computed as it does."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        self.config = config
        self.total_upsample = math.prod((*config.upsample_rates, *config.upsampling_ratios))
        self.pre_transformer = LatentTransformer._from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
        self.quantizer = SplitResidualVectorQuantizer(config)
        latent = config.latent_dim
        self.pre_conv = Qwen3OmniMoeCausalConvNet(config.codebook_dim, latent, kernel_size=3)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    Qwen3OmniMoeCausalTransConvNet(latent, latent, factor, factor),
                    Qwen3OmniMoeConvNeXtBlock(latent),
                ]
            )
            for factor in config.upsampling_ratios
        )
        output_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        self.decoder = nn.ModuleList(
            [
                Qwen3OmniMoeCausalConvNet(latent, config.decoder_dim, 7),
                *(DecoderBlock(config, i) for i in range(len(config.upsample_rates))),
                Qwen3OmniMoeSnakeBeta(output_dim),
                Qwen3OmniMoeCausalConvNet(output_dim, 1, 7),
            ]
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, num_quantizers, T]`` to samples ``[B, 1, T * total_upsample]`` in
        [-1, 1]."""
        if codes.shape[1] != self.config.num_quantizers:
            raise ValueError(
                f"Expected {self.config.num_quantizers} layer of codes, got {codes.shape[1]}"
            )
        return self.upsample_latents(self.latents(codes))

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """``forward``'s first half: the quantizers' latents through the ``pre_conv`` and the
        transformer, ``[B, T, latent_dim]`` (a stream runs it from its window's first frame)."""
        hidden = self.quantizer.decode(codes)
        return self.pre_transformer.latents(self.pre_conv(hidden).transpose(1, 2))

    def upsample_latents(self, hidden: torch.Tensor) -> torch.Tensor:
        """``forward``'s second half, the convolutional stack on ``[B, T, latent_dim]``:
        ``[B, 1, T * total_upsample]`` in [-1, 1]."""
        hidden = hidden.permute(0, 2, 1)
        for blocks in self.upsample:
            for block in blocks:  # type: ignore[attr-defined]
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    def front_convs(self) -> list[tuple[nn.Conv1d, int]]:
        """The convolutions ``latents`` runs, each with how much longer than the codes its
        input is (the quantizers' output projections, then the causal ``pre_conv``)."""
        rvqs = (self.quantizer.rvq_first, self.quantizer.rvq_rest)
        found = [(rvq.output_proj, 0) for rvq in rvqs]
        return [*found, (self.pre_conv.conv, int(self.pre_conv.padding))]

    def chunked_decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The reference's ``chunked_decode(codes, chunk_size=300, left_context_size=25)``:
        each window decoded with its left context, whose samples are dropped."""
        pieces = []
        for first, start, end in windows(int(codes.shape[-1])):
            wav = self(codes[..., first:end])
            pieces.append(wav[..., (start - first) * self.total_upsample :])
        return torch.cat(pieces, dim=-1)


def build_empty(config: Qwen3OmniMoeCode2WavConfig) -> SpeechDecoder:
    """``SpeechDecoder(config)`` with parameters on ``meta``, float32, in eval mode."""
    with parameters_on_meta():
        module = SpeechDecoder(config)
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module.float()
    module.eval()
    module.requires_grad_(False)
    return module


# -- the decoder in an arena ------------------------------------------------------------------


def tokenizer_folder(folder: str | Path) -> Path:
    """A checkpoint's ``speech_tokenizer`` folder (``folder`` itself if it is one)."""
    path = Path(folder)
    return path / FOLDER if (path / FOLDER / "config.json").is_file() else path


class Qwen3TTSDecoder(VocoderWeights):
    """The speech-tokenizer decoder of one Qwen3-TTS checkpoint, in ``arena``."""

    part = PART
    names_hint = _NAMES_HINT
    _parts = ()  # only 'decoder.*' names are the decoder's (the file's 'encoder.*' are not)

    def __init__(self, folder: str | Path, arena: Arena, *, load: bool = True) -> None:
        self.folder = tokenizer_folder(folder)
        self.device = arena.device
        raw = read_tokenizer_config(self.folder)
        self.config = decoder_config(raw, self.folder / "config.json")
        self.module = build_empty(self.config)
        self.weight_bytes = arena.adopt(self.module)
        self._derived = move_derived_buffers(self.module, self.device)
        self.codes_per_frame = int(self.config.num_quantizers)
        self.samples_per_frame = int(self.module.total_upsample)
        declared = raw.get("decode_upsample_rate", self.samples_per_frame)
        if declared != self.samples_per_frame:
            raise CheckpointError(
                f"{shown(self.folder / 'config.json')}: decode_upsample_rate {shown(declared)} "
                f"is not the decoder's {self.samples_per_frame} samples per frame"
            )
        self.sample_rate = SAMPLE_RATE
        if load:
            self.load_weights(self.folder, strict=True)

    @classmethod
    def from_folder(cls, folder: str | Path, arena: Arena) -> Qwen3TTSDecoder:
        """The decoder of a checkpoint folder (or of its ``speech_tokenizer`` folder)."""
        return cls(folder, arena)

    @property
    def codebook_size(self) -> int:
        """Codes are in ``[0, codebook_size)``, for every quantizer."""
        return int(self.config.codebook_size)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """One ``forward`` over codes ``[B, Q, T]``: ``[B, 1, T * samples_per_frame]``."""
        return self.module(codes.to(self.device))

    @torch.inference_mode()
    def chunked_decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, Q, T]`` decoded as the reference's ``decode`` does (windows of 300)."""
        return self.module.chunked_decode(codes.to(self.device))

    def load_weights(
        self, path: str | Path, strict: bool = True, *, check_finite: bool = False
    ) -> int:
        """``VocoderWeights.load_weights`` from a checkpoint folder's speech tokenizer (a
        level-2 wake reloads from the stage's model folder), or a given file or folder."""
        return super().load_weights(tokenizer_folder(path), strict, check_finite=check_finite)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live weights by checkpoint name (``decoder.<tensor>``)."""
        return {f"{PART}{key}": t for key, t in module_targets(self.module).items()}
