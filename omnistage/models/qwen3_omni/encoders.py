"""The thinker's audio and vision encoders: transformers' own ``Qwen3OmniMoeAudioEncoder`` and
``Qwen3OmniMoeVisionEncoder`` (sdpa attention), each wrapped to turn one multimodal item's
data (``inputs``) into the embeddings of its placeholders, as the thinker's
``get_audio_features`` / ``get_image_features`` / ``get_video_features`` compute them and its
forward merges them. A video goes through the vision encoder as a picture with a temporal
grid (``pixel_values_videos`` ``[t * h * w, C * T * P * P]``, ``video_grid_thw`` ``[1, 3]``),
and with its audio track through both (``omni_encoders.VideoEncoder``).

The audio encoder splits an audio's mel frames into chunks of ``2 * n_window`` frames, each
downsampled 8x by three stride-2 convolutions, and attends within windows of
``n_window_infer`` frames' worth of outputs; all of that is transformers' own code, run on one
audio at a time (as the thinker runs it for a prompt of one audio: with several, transformers
sizes the windows by the longest chunk of the batch, which here is the item's own).

The vision encoder's output is ``[1 + k, length, hidden]``: the placeholders' embeddings, then
its DeepStack features (one per ``deepstack_visual_indexes`` layer, through its
``merger_list``), which the decoder adds to its hidden states at the placeholders' positions
after its layers ``0 .. k - 1`` (the model runner's encoder step: an encoder output with a
leading dimension carries rows added after the first layers), as transformers'
``_deepstack_process`` does.

They sit in the thinker decoder's ``encoders`` (``thinker_encoders``): ``audio`` and ``image``
own the audio tower and the vision encoder (``encoders.audio.audio_tower.*``,
``encoders.image.visual.*``: the checkpoint's ``thinker.audio_tower.*`` and
``thinker.visual.*``); ``video`` uses both without registering them. Parameters are built
on ``meta`` (the stage adopts and loads them); derived buffers (the sinusoid table, the
vision rotary frequencies) are computed for real on the CPU and follow the weights to their
device on first use. They hold no tensor-parallel layers: every rank runs them whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from omnistage.models import omni_encoders
from omnistage.models.omni_encoders import check, checked_grid, follow_weights


def audio_output_length(frames: int, n_window: int) -> int:
    """Encoder outputs (placeholder tokens) of ``frames`` mel frames: per whole chunk of
    ``2 * n_window`` frames 13, and the rest's three stride-2 convolutions (transformers'
    ``_get_feat_extract_output_lengths``)."""
    chunk = 2 * n_window
    rest = (frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


class AudioEncoder(nn.Module):
    """``audio`` items: ``input_features`` ``[mel, frames]`` (the unpadded frames)."""

    def __init__(self, audio_tower: nn.Module) -> None:
        super().__init__()
        self.audio_tower = audio_tower

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        tower: Any = self.audio_tower
        mel = tower.config.num_mel_bins
        check(
            input_features.dim() == 2
            and input_features.shape[0] == mel
            and input_features.shape[1] >= 1,
            "input_features",
            f"must be [{mel}, frames >= 1]",
        )
        follow_weights(tower)
        lengths = torch.tensor([input_features.shape[1]], device=input_features.device)
        embeds: torch.Tensor = tower(input_features, feature_lens=lengths).last_hidden_state
        return embeds


def vision_features(visual: Any, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``[1 + k, patches / merge^2, hidden]``: one image's (or video's) embeddings and its k
    DeepStack features, from its patches and grid ``[1, 3]``."""
    grid, t, h, w = checked_grid(visual, grid)
    config = visual.config
    patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
    check(
        pixels.dim() == 2 and tuple(pixels.shape) == (t * h * w, patch),
        "pixel_values",
        f"must be [{t * h * w}, {patch}] for grid {[t, h, w]}",
    )
    follow_weights(visual)
    weight = next(visual.parameters())
    out = visual(pixels.type(weight.dtype), grid_thw=grid)
    return torch.stack([out.pooler_output, *out.deepstack_features])


class ImageEncoder(nn.Module):
    """``image`` items: ``pixel_values`` ``[patches, C * T * P * P]``, ``image_grid_thw``
    (and a video's patches and grid, for ``VideoEncoder``); the output carries the DeepStack
    features after the embeddings (``[1 + k, n, hidden]``)."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        features = vision_features(self.visual, pixel_values, image_grid_thw)
        return features if len(features) > 1 else features[0]


def thinker_encoders(configs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, nn.Module]:
    """The encoders by modality (``omni_encoders.thinker_encoders``) over Qwen3-Omni's towers."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    towers = (hf.Qwen3OmniMoeAudioEncoder, hf.Qwen3OmniMoeVisionEncoder)
    return omni_encoders.thinker_encoders(configs, dtype, towers, AudioEncoder, ImageEncoder)
