"""``DiffusionRequestPreparer``: validate diffusion requests in the API process, against the
limits the stage reported (image size, steps, embedding width)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.stage.diffusion.params import (
    DiffusionParams,
    check_prompt_embeds,
    validate_params,
)
from omnistage.stage.diffusion.wire import DiffusionStageInfo, DiffusionStageRequest
from omnistage.stage.prepare import RequestOptions, check_mapping

FIELD = "image_params"


class DiffusionRequestPreparer:
    PROMPT_FIELDS = ("prompt", "prompt_embeds", "negative_prompt", "negative_prompt_embeds")

    def __init__(self, config: StageConfig, info: DiffusionStageInfo) -> None:
        self.config = config
        self.limits = info.limits

    def params(self, options: RequestOptions, negative_prompt: Any = None) -> DiffusionParams:
        data = dict(check_mapping(options.params.get(FIELD), FIELD))
        if negative_prompt is not None:
            data.setdefault("negative_prompt", negative_prompt)
        unknown = sorted(set(data) - set(DiffusionParams.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                f"{FIELD}.{unknown[0]}",
                f"unknown parameter; known: {sorted(DiffusionParams.__struct_fields__)}",
            )
        data.setdefault("guidance_scale", self.limits.default_guidance_scale)
        params = DiffusionParams(**data)
        validate_params(params, self.limits)
        return params

    def check_options(self, options: RequestOptions, downstream: bool = False) -> None:
        self.params(options)

    def num_samples(self, options: RequestOptions) -> int:
        return 1

    def template(self, options: RequestOptions, wants: Wants) -> DiffusionStageRequest:
        """The request of a stage fed by another: its parameters, the prompt to come."""
        return DiffusionStageRequest(params=self.params(options))

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: Wants
    ) -> DiffusionStageRequest:
        text = prompt.get("prompt")
        embeds = prompt.get("prompt_embeds")
        if (text is None) == (embeds is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or prompt_embeds")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidRequestError("prompt", "must be a string")
            if not self.limits.has_text_encoder:
                raise InvalidRequestError(
                    "prompt",
                    "this pipeline has no text encoder; pass prompt_embeds "
                    f"[seq, {self.limits.embedding_dim}] instead",
                )
        else:
            check_prompt_embeds("prompt_embeds", embeds, self.limits)
        negative = prompt.get("negative_prompt_embeds")
        if negative is not None:
            check_prompt_embeds("negative_prompt_embeds", negative, self.limits)
        return DiffusionStageRequest(
            prompt=text,
            prompt_embeds=embeds if isinstance(embeds, torch.Tensor) else None,
            negative_prompt_embeds=negative,
            params=self.params(options, prompt.get("negative_prompt")),
        )
