"""What the omni families' thinker encoders (Qwen2.5-Omni's, Qwen3-Omni's) share: the audio
tower and vision encoder built on ``meta`` in the stage's dtype, their derived buffers
following the weights to their device, and the checks of an item's data (an
``InvalidRequestError`` naming ``multi_modal.data.<name>``).
"""

from __future__ import annotations

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
