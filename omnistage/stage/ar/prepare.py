"""``ARRequestPreparer``: tokenize and validate AR requests in the API process.

Only the tokenizer is loaded here (``tokenizers`` + jinja2), never the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError, RequestTooLargeError
from omnistage.models.tokenizer import Tokenizer
from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.messages import ARStageInfo, ARStageRequest
from omnistage.stage.prepare import HIDDEN_STATES, RequestOptions, check_mapping


class ARRequestPreparer:
    def __init__(self, config: StageConfig, info: ARStageInfo) -> None:
        self.config = config
        self.info = info
        self.tokenizer = Tokenizer.from_pretrained(config.model)

    def sampling_params(self, options: RequestOptions) -> SamplingParams:
        data = dict(check_mapping(options.sampling_params, "sampling_params"))
        unknown = sorted(set(data) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                f"sampling_params.{unknown[0]}",
                f"unknown sampling parameter; known: {sorted(SamplingParams.__struct_fields__)}",
            )
        try:
            return SamplingParams(**data)
        except InvalidRequestError as exc:
            raise exc.under("sampling_params") from None

    def check_options(self, options: RequestOptions) -> None:
        self.sampling_params(options)

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: frozenset[str]
    ) -> ARStageRequest:
        sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in prompt]
        if len(sources) != 1:
            raise InvalidRequestError(
                "prompt", "give exactly one of prompt, prompt_token_ids, messages"
            )
        text = prompt.get("prompt")
        if sources[0] == "messages":
            token_ids = self.tokenizer.encode_chat(_messages(prompt["messages"]))
        elif sources[0] == "prompt":
            if not isinstance(text, str):
                raise InvalidRequestError("prompt", "must be a string")
            token_ids = self.tokenizer.encode(text)
        else:
            token_ids = self._token_ids(prompt["prompt_token_ids"])
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        if len(token_ids) >= self.info.max_model_len:
            raise RequestTooLargeError(
                "prompt",
                f"{len(token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.info.max_model_len}",
            )
        return ARStageRequest(
            prompt_token_ids=token_ids,
            sampling_params=self.sampling_params(options),
            return_hidden_states=HIDDEN_STATES in wants,
            prompt=text if isinstance(text, str) else None,
        )

    def _token_ids(self, value: Any) -> list[int]:
        vocab = self.info.vocab_size
        if not isinstance(value, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
        bad = next((t for t in value if not 0 <= t < vocab), None)
        if bad is not None:
            # "prompt": what the OpenAI completions API calls a list of token ids
            raise InvalidRequestError(
                "prompt", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        return list(value)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidRequestError("messages", "must be a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages.{i}", "must be an object with a string 'role'")
    return [dict(m) for m in value]
