"""What the omni families' thinker encoders (Qwen2.5-Omni's, Qwen3-Omni's) share: the audio
tower and vision encoder built on ``meta`` in the stage's dtype, their derived buffers
following the weights to their device, the checks of an item's data (an
``InvalidRequestError`` naming ``multi_modal.data.<name>``), and the video encoder over the
family's image and audio encoders (a video with its audio track: both, interleaved).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from omnistage.errors import InvalidRequestError
from omnistage.models.meta import move_derived_buffers, parameters_on_meta

ATTENTION = "sdpa"


def follow_weights(module: nn.Module) -> None:
    """Put ``module``'s non-persistent buffers on its weights' device (the arena holds only
    weights; derived buffers are built on the CPU)."""
    move_derived_buffers(module, next(module.parameters()).device)


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"multi_modal.data.{name}", message)


def checked_grid(visual: Any, grid: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """An image's or video's grid as ``[1, 3]`` and its ``t, h, w``, checked against the
    vision encoder's merge size."""
    grid = grid.reshape(-1, 3)
    check(len(grid) == 1, "grid_thw", "must be one [t, h, w]")
    t, h, w = (int(v) for v in grid[0])
    merge = int(visual.config.spatial_merge_size)
    check(
        min(t, h, w) >= 1 and h % merge == 0 and w % merge == 0,
        "grid_thw",
        f"must be positive, h and w multiples of {merge}",
    )
    return grid, t, h, w


def build_towers(
    audio_class: Any, audio_config: Any, vision_class: Any, vision_config: Any, dtype: torch.dtype
) -> tuple[nn.Module, nn.Module]:
    """The audio tower and the vision encoder (sdpa attention), parameters on ``meta`` in
    ``dtype``, in eval mode."""
    for config in (audio_config, vision_config):
        config._attn_implementation = ATTENTION
    with parameters_on_meta():
        audio_tower = audio_class(audio_config)
        visual = vision_class(vision_config)
    for module in (audio_tower, visual):
        module.eval()
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is not None and param.dtype != dtype:
                    sub._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)
    return audio_tower, visual


class VideoEncoder(nn.Module):
    """``video`` items: ``pixel_values_videos``, ``video_grid_thw`` through the family's
    image encoder (a video is a picture with a temporal grid); a video with its audio track
    also ``input_features`` through its audio encoder and ``is_video`` (bool, per
    placeholder: video or audio token), whose embeddings come interleaved in that order. An
    image encoder's output ``[1 + k, n, hidden]`` (DeepStack rows after the embeddings) keeps
    its k rows at the video tokens, zero at the audio ones (transformers adds DeepStack rows
    at visual positions only). Shares the other encoders without registering them, so each
    module is adopted into the arena and loaded once."""

    def __init__(self, image: nn.Module, audio: nn.Module) -> None:
        super().__init__()
        self._shared = (image, audio)  # a tuple: not submodules

    def forward(
        self,
        pixel_values_videos: torch.Tensor,
        video_grid_thw: torch.Tensor,
        input_features: torch.Tensor | None = None,
        is_video: torch.Tensor | None = None,
    ) -> torch.Tensor:
        image, audio_encoder = self._shared
        video: torch.Tensor = image(pixel_values_videos, video_grid_thw)
        if input_features is None and is_video is None:
            return video
        if input_features is None or is_video is None:
            raise InvalidRequestError(
                "multi_modal.data.is_video", "input_features and is_video come together"
            )
        audio: torch.Tensor = audio_encoder(input_features)
        mask = is_video.to(device=video.device, dtype=torch.bool).flatten()
        count = video.shape[-2]
        check(
            int(mask.sum()) == count and len(mask) == count + len(audio),
            "is_video",
            f"must mark {count} video tokens among {count + len(audio)}",
        )
        out = video.new_zeros(*video.shape[:-2], len(mask), video.shape[-1])
        out[..., mask, :] = video
        out.view(-1, len(mask), video.shape[-1])[0, ~mask] = audio.to(video.dtype)
        return out


def thinker_encoders(
    configs: Mapping[str, Any],
    dtype: torch.dtype,
    towers: tuple[Any, Any],
    audio_encoder: Callable[[nn.Module], nn.Module],
    image_encoder: Callable[[nn.Module], nn.Module],
) -> dict[str, nn.Module]:
    """The encoders by modality, from the thinker's ``audio_config`` and ``vision_config``
    (``ARModelConfig.extras``): ``towers``, transformers' audio and vision encoder classes
    (each built from its ``config_class``, parameters on ``meta`` in ``dtype``), wrapped by
    the family's ``audio_encoder`` and ``image_encoder``; ``video`` a ``VideoEncoder`` over
    both."""
    audio_class, vision_class = towers
    audio_config = audio_class.config_class.from_dict(dict(configs["audio_config"]))
    vision_config = vision_class.config_class.from_dict(dict(configs["vision_config"]))
    audio_tower, visual = build_towers(
        audio_class, audio_config, vision_class, vision_config, dtype
    )
    audio, image = audio_encoder(audio_tower), image_encoder(visual)
    return {"audio": audio, "image": image, "video": VideoEncoder(image, audio)}
