"""``Code2WavRequestPreparer``: validate code2wav requests in the API process, against the
limits the stage reported (voices, codebook size, most codes). No model code is loaded here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.stage.code2wav.params import Code2WavParams
from omnistage.stage.code2wav.request import check_codes, check_voice
from omnistage.stage.code2wav.wire import Code2WavStageInfo, Code2WavStageRequest
from omnistage.stage.request_preparer import VLLM_SAMPLING_FIELDS, RequestOptions, check_mapping

FIELD = "audio_params"


class Code2WavRequestPreparer:
    PROMPT_FIELDS = ("codes",)

    def __init__(self, config: StageConfig, info: Code2WavStageInfo) -> None:
        self.config = config
        self.limits = info.limits

    def params(self, options: RequestOptions) -> Code2WavParams:
        data = dict(check_mapping(options.params.get(FIELD), FIELD))
        try:
            params = Code2WavParams.from_dict(data)
            check_voice(params.voice, self.limits)
        except InvalidRequestError as exc:
            raise exc.under(FIELD) from None
        except TypeError as exc:  # a key that is not a string
            raise InvalidRequestError(FIELD, f"keys must be parameter names: {exc}") from None
        return params

    @property
    def params_field(self) -> str:
        return FIELD

    def from_vllm(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """This stage's own keys (``seed``, ``voice``, ...); vLLM's sampling keys vLLM-Omni
        sends every stage mean nothing to a stage that does not sample, and are dropped, as
        vLLM-Omni's code2wav drops them."""
        data = dict(check_mapping(entry, ""))
        own = {k: v for k, v in data.items() if k in Code2WavParams.__struct_fields__}
        unknown = sorted(set(data) - set(own) - VLLM_SAMPLING_FIELDS)
        if unknown:
            raise InvalidRequestError(
                unknown[0],
                f"unknown parameter; this stage takes {sorted(Code2WavParams.__struct_fields__)} "
                "(and ignores vLLM's sampling keys: it does not sample)",
            )
        Code2WavParams.from_dict(own)
        return own

    def normalize(self, options: RequestOptions) -> RequestOptions:
        """A voice named in any case is the checkpoint's voice of that name."""
        params = options.params.get(FIELD)
        if not isinstance(params, Mapping):
            return options
        voice = params.get("voice")
        if not isinstance(voice, str) or voice in self.limits.voices:
            return options
        by_case = {v.casefold(): v for v in self.limits.voices}
        if voice.casefold() not in by_case:
            return options  # refused by the check, naming the voices
        fixed = {**options.params, FIELD: {**params, "voice": by_case[voice.casefold()]}}
        return RequestOptions(fixed)

    def check_options(self, options: RequestOptions, downstream: bool = False) -> None:
        self.params(options)

    def num_samples(self, options: RequestOptions) -> int:
        return 1

    def template(self, options: RequestOptions, wants: Wants) -> Code2WavStageRequest:
        """The request of a stage fed by another: its parameters, the codes to come."""
        return Code2WavStageRequest(codes=[], params=self.params(options))

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: Wants
    ) -> Code2WavStageRequest:
        if "codes" not in prompt:
            raise InvalidRequestError("codes", "is required: the speech-codec tokens to speak")
        return Code2WavStageRequest(
            codes=check_codes(prompt["codes"], self.limits), params=self.params(options)
        )
