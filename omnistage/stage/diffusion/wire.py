"""What crosses the wire for a diffusion stage: its request, what it reports at start-up,
and the image or video it returns (``ImageOutput``, ``VideoOutput``; the parameters in
``params``)."""

from __future__ import annotations

import msgspec
import torch

from omnistage.stage.diffusion.params import DiffusionParams, ImageOutput, PipelineLimits
from omnistage.stage.diffusion.video import VideoOutput

KIND = "diffusion"


class DiffusionStageRequest(msgspec.Struct, tag=KIND, forbid_unknown_fields=True):
    """A text prompt or conditioning embeddings ``[seq, dim]`` for a diffusion stage."""

    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    params: DiffusionParams = msgspec.field(default_factory=DiffusionParams)


class DiffusionStageInfo(msgspec.Struct, tag=KIND):
    """What the API process needs to validate requests for a diffusion stage."""

    limits: PipelineLimits


# What the kinds map reads of this kind (``omnistage.stage.kinds``).
REQUEST, INFO, OUTPUT = DiffusionStageRequest, DiffusionStageInfo, ImageOutput | VideoOutput

__all__ = ["KIND", "DiffusionStageInfo", "DiffusionStageRequest", "ImageOutput", "VideoOutput"]
