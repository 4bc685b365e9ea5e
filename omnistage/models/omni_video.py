"""A video's frames as ``Qwen2VLVideoProcessor`` patches them for the omni families' vision
encoders, in torch (no torchvision): ``pixel_values_videos`` and the grid."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def video_pixels(
    frames: np.ndarray, size: tuple[int, int], ip: Any
) -> tuple[torch.Tensor, list[int]]:
    """``pixel_values_videos`` ``[t * h * w, C * T * P * P]`` and the grid ``[t, h, w]`` of
    frames ``[T, H, W, 3]`` (uint8), as ``Qwen2VLVideoProcessor`` makes them with torchvision,
    with the normalisation and patch sizes of ``ip`` (a ``Qwen2VLImageProcessorPil``):
    resized to ``size`` (bicubic, antialiased, on uint8) unless already that size; rescaled
    and normalised in one step, ``(x - 255 mean) / (255 std)`` in float32; the frame count
    padded to a multiple of ``temporal_patch_size`` with the last frame; patches ordered by
    time, then merge window, then patch within the window."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if tuple(video.shape[-2:]) != size:
        video = F.interpolate(video, size=size, mode="bicubic", align_corners=False, antialias=True)
    scale = 1.0 / ip.rescale_factor
    mean_t = (torch.tensor(list(ip.image_mean)) * scale).view(-1, 1, 1)
    std_t = (torch.tensor(list(ip.image_std)) * scale).view(-1, 1, 1)
    video = (video.to(torch.float32) - mean_t) / std_t
    tp, m, p = ip.temporal_patch_size, ip.merge_size, ip.patch_size
    if pad := -len(video) % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames_, channels, height, width = video.shape
    grid = [frames_ // tp, height // p, width // p]
    patches = video.view(grid[0], tp, channels, grid[1] // m, m, p, grid[2] // m, m, p).permute(
        0, 3, 6, 4, 7, 2, 1, 5, 8
    )
    return patches.reshape(grid[0] * grid[1] * grid[2], -1), grid
