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
from omnistage.stage.request_preparer import RequestOptions, check_mapping

FIELD = "image_params"


class DiffusionRequestPreparer:
    PROMPT_FIELDS = ("prompt", "prompt_embeds", "negative_prompt", "negative_prompt_embeds")

    def __init__(self, config: StageConfig, info: DiffusionStageInfo) -> None:
        self.config = config
        self.limits = info.limits

    @property
    def params_field(self) -> str:
        return FIELD

    def params(self, options: RequestOptions, negative_prompt: Any = None) -> DiffusionParams:
        data = self._own_names(dict(check_mapping(options.params.get(FIELD), FIELD)), FIELD)
        if negative_prompt is not None:
            data.setdefault("negative_prompt", negative_prompt)
        data.setdefault("guidance_scale", self.limits.default_guidance_scale)
        params = DiffusionParams(**data)
        validate_params(params, self.limits)
        return params

    def _own_names(self, data: dict[str, Any], where: str) -> dict[str, Any]:
        """``data`` with diffusers' other names for a parameter in ours (the family's
        ``param_aliases``: e.g. a pipeline's ``true_cfg_scale`` is its ``guidance_scale``); a
        name this folder's pipeline does not take is refused naming the pipeline."""
        known = set(DiffusionParams.__struct_fields__)
        for alias, name in self.limits.param_aliases.items():
            if alias not in data:
                continue
            value = data.pop(alias)
            if name in data and data[name] != value:
                raise InvalidRequestError(
                    _under(where, alias), f"is this pipeline's {name}; the two differ, give one"
                )
            data[name] = value
        unknown = sorted(set(data) - known)
        if unknown:
            family = self.limits.family or "this pipeline"
            raise InvalidRequestError(
                _under(where, unknown[0]),
                f"not taken by {family} (this folder); it takes "
                f"{sorted(known | set(self.limits.param_aliases))}",
            )
        return data

    def from_vllm(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """A diffusion stage's entry holds diffusers' names (vLLM-Omni's
        ``OmniDiffusionSamplingParams``)."""
        data = self._own_names(dict(check_mapping(entry, "")), "")
        self._check_own_values(data)
        return data

    def _check_own_values(self, data: dict[str, Any]) -> None:
        """Each value of a list entry in its range, so a 400 names it under the entry
        (``sampling_params_list.0.guidance_scale``); checks across fields wait for the
        merged parameters. The entry is checked beside the smallest valid size."""
        step = self.limits.size_multiple
        video = any(key in data for key in ("num_frames", "fps", "seconds"))
        trial: dict[str, Any] = {"height": step, "width": step, "video": video}
        trial["guidance_scale"] = self.limits.default_guidance_scale
        if video and self.limits.max_frames <= 1:
            return  # "this pipeline makes images": the merged check says it
        try:
            validate_params(DiffusionParams(**{**trial, **data}), self.limits)
        except InvalidRequestError as exc:
            if exc.field in data:
                raise
        except TypeError:
            return  # a wrong type: the merged check names it

    def normalize(self, options: RequestOptions) -> RequestOptions:
        return options

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


def _under(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
