"""The thinker's audio and vision encoders: transformers' own ``Qwen2_5OmniAudioEncoder`` and
``Qwen2_5OmniVisionEncoder`` (sdpa attention), each wrapped to turn one multimodal item's
data (``inputs``) into the embeddings of its placeholders, ``[length, hidden]``, as the
thinker's ``get_audio_features`` / ``get_image_features`` / ``get_video_features`` compute
them and its forward merges them.

They sit in the thinker decoder's ``encoders`` (``thinker_encoders``): ``audio`` and ``image``
own the audio tower and the vision encoder (``encoders.audio.audio_tower.*``,
``encoders.image.visual.*``: the checkpoint's ``thinker.audio_tower.*`` and
``thinker.visual.*``); ``video`` (``omni_encoders.VideoEncoder``) uses both without
registering them, so each is adopted into the arena and loaded once. Parameters are built on
``meta`` (the stage adopts and loads them); derived buffers (the audio tower's sinusoid
table, the vision rotary frequencies) are computed for real on the CPU and follow the weights
to their device on first use. They hold no tensor-parallel layers: every rank runs them whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from omnistage.models import omni_encoders
from omnistage.models.omni_encoders import check, checked_grid, follow_weights


def audio_embeddings(tower: Any, input_features: torch.Tensor) -> torch.Tensor:
    """``[tokens, hidden]`` of one audio's mel frames ``[mel, frames]`` (its unpadded frames),
    as ``get_audio_features`` computes them."""
    mel = tower.config.num_mel_bins
    check(
        input_features.dim() == 2
        and input_features.shape[0] == mel
        and input_features.shape[1] > 2,
        "input_features",
        f"must be [{mel}, frames >= 3]",
    )
    follow_weights(tower)
    lengths = torch.tensor([input_features.shape[1]], device=input_features.device)
    after_cnn = (lengths - 1) // 2 + 1  # the first convolution's output length
    out = tower(input_features, feature_lens=lengths, aftercnn_lens=after_cnn)
    embeds: torch.Tensor = out.last_hidden_state
    return embeds


def vision_embeddings(visual: Any, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``[patches / merge^2, hidden]`` of one image's or video's patches and grid ``[1, 3]``."""
    grid, t, h, w = checked_grid(visual, grid)
    check(
        pixels.dim() == 2 and pixels.shape[0] == t * h * w,
        "pixel_values",
        f"must be [{t * h * w}, patch] for grid {[t, h, w]}",
    )
    follow_weights(visual)
    weight = next(visual.parameters())
    embeds: torch.Tensor = visual(pixels.type(weight.dtype), grid_thw=grid).pooler_output
    return embeds


class AudioEncoder(nn.Module):
    """``audio`` items: ``input_features`` ``[mel, frames]``."""

    def __init__(self, audio_tower: nn.Module) -> None:
        super().__init__()
        self.audio_tower = audio_tower

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return audio_embeddings(self.audio_tower, input_features)


class ImageEncoder(nn.Module):
    """``image`` items: ``pixel_values`` ``[patches, C * T * P * P]``, ``image_grid_thw``."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return vision_embeddings(self.visual, pixel_values, image_grid_thw)


def thinker_encoders(configs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, nn.Module]:
    """The encoders by modality (``omni_encoders.thinker_encoders``) over Qwen2.5-Omni's towers."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

    towers = (hf.Qwen2_5OmniAudioEncoder, hf.Qwen2_5OmniVisionEncoder)
    return omni_encoders.thinker_encoders(configs, dtype, towers, AudioEncoder, ImageEncoder)
