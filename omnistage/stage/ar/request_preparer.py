"""``ARRequestPreparer``: tokenize and validate AR requests in the API process.

Only the tokenizer is loaded here (``tokenizers`` + jinja2), never the model. The stage says,
in its ``ARStageInfo``, how its model family sets requests up: which request field its
sampling parameters come from (``params_field``: ``sampling_params``, or e.g. a speech stage's
``talker_params``), the defaults under the user's, and stop ids it always adds to the user's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from omnistage.config import StageConfig
from omnistage.errors import ContextLengthError, InvalidRequestError
from omnistage.models.media import MediaItem, PromptProcessor, media_items
from omnistage.models.processors import Wants
from omnistage.models.tokenizer import Tokenizer
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import ARStageInfo, ARStageRequest, MultiModalItem
from omnistage.stage.request_preparer import RequestOptions, check_mapping

# Limits a request may give as None, meaning "none asked for": the stage's default
# (``override_generation_config``, a family's defaults) applies, else no limit.
_DEFAULT_WHEN_NONE = frozenset({"max_tokens"})


class ARRequestPreparer:
    PROMPT_FIELDS = (
        "prompt",
        "prompt_token_ids",
        "messages",
        "prompt_embeds",
        "token_embeds_from",
        "decode_embeds",
        "multi_modal",
        "multi_modal_data",
        "mm_processor_kwargs",
        "prompt_spec",
        "forced_token_ids",
    )

    def __init__(self, config: StageConfig, info: ARStageInfo) -> None:
        self.config = config
        self.info = info
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self._prompt_processor: PromptProcessor | None = None
        self._build_lock = threading.Lock()

    @property
    def params_field(self) -> str:
        return self.info.params_field

    def sampling_params(self, options: RequestOptions, downstream: bool = False) -> SamplingParams:
        name = self.params_field
        data = dict(check_mapping(options.params.get(name), name))
        unknown = sorted(set(data) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                f"{name}.{unknown[0]}",
                f"unknown sampling parameter; known: {sorted(SamplingParams.__struct_fields__)}",
            )
        if downstream and data.get("n", 1) != 1:
            raise InvalidRequestError(
                f"{name}.n", "a stage fed by another stage serves one sample per request"
            )
        if self.info.param_defaults or self.info.stop_token_ids:
            stops = list(
                dict.fromkeys([*(data.get("stop_token_ids") or []), *self.info.stop_token_ids])
            )
            unset = {k for k, v in data.items() if v is None and k in _DEFAULT_WHEN_NONE}
            data = {
                **self.info.param_defaults,
                **{k: v for k, v in data.items() if k not in unset},
                "stop_token_ids": stops,
            }
            for key in unset:  # "no limit asked for": the stage's default, else none
                data.setdefault(key, None)
        try:
            return SamplingParams(**data)
        except InvalidRequestError as exc:
            raise exc.under(name) from None

    def from_vllm(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's sampling keys. ``detokenize`` is how this stage works anyway: its tokens
        become text when it answers text, never when they are codes; ``false`` on a text
        stage (its answer without text) is not implemented."""
        data = dict(check_mapping(entry, ""))
        detokenize = data.pop("detokenize", True)
        if not isinstance(detokenize, bool):
            raise InvalidRequestError("detokenize", f"must be a boolean, got {detokenize!r}")
        if not detokenize and self.info.emits_text:
            raise InvalidRequestError(
                "detokenize", "false is not implemented for a stage whose answer is text"
            )
        unknown = sorted(set(data) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                unknown[0],
                f"unknown sampling parameter; known: {sorted(SamplingParams.__struct_fields__)}",
            )
        SamplingParams(**data)  # each value checked, named as the entry has it
        return data

    def normalize(self, options: RequestOptions) -> RequestOptions:
        return options

    def check_options(self, options: RequestOptions, downstream: bool = False) -> None:
        self.sampling_params(options, downstream)

    def num_samples(self, options: RequestOptions) -> int:
        return self.sampling_params(options).n

    def template(self, options: RequestOptions, wants: Wants) -> ARStageRequest:
        """The request of a stage fed by another: its parameters; the prompt is filled in
        the stage from what the stage before handed over."""
        return ARStageRequest(
            prompt_token_ids=[],
            sampling_params=self.sampling_params(options, downstream=True),
            return_hidden_states=wants.hidden_states,
            hidden_states_with_embeddings=wants.hidden_states_with_embeddings,
            text_embeddings_only=wants.text_embeddings_only,
            hidden_layer=wants.hidden_layer,
            stream_hidden_states=wants.streamed,
            embed_token_ids=list(wants.embed_token_ids) or None,
        )

    def _refuse_surely_too_long(self, prompt: Mapping[str, Any], source: str) -> None:
        """Refuse, before tokenizing it, a text too long for ``max_model_len`` tokens however it
        tokenizes: no token stands for more than ``max_token_chars`` characters (twice that,
        for normalizers that shrink text). Tokenizing megabytes takes seconds of a core and,
        in parts, the GIL: the event loop would stall for a request that is refused anyway."""
        if source == "prompt_token_ids":
            return
        chars = _text_chars(prompt[source])
        limit = 2 * self.tokenizer.max_token_chars * self.info.max_model_len
        if chars > limit:
            raise ContextLengthError(
                source,
                f"This model's maximum context length is {self.info.max_model_len} tokens. "
                f"However, you requested more: {chars} characters are more than "
                f"max_model_len={self.info.max_model_len} tokens can hold (at most {limit} "
                "characters with this tokenizer). Please reduce the length of the prompt.",
            )

    def _refuse_media_surely_too_long(
        self, processor: PromptProcessor, token_ids: list[int], media: list[MediaItem]
    ) -> None:
        """Refuse, before its media are processed, a prompt whose media alone surely pass
        ``max_model_len`` (the processor's ``min_tokens``, from their lengths): featurizing
        ten minutes of audio to refuse it after took hundreds of MB and a core for seconds."""
        tokens = len(token_ids) + processor.min_tokens(media)
        if tokens >= self.info.max_model_len:
            raise ContextLengthError(
                "prompt",
                f"This model's maximum context length is {self.info.max_model_len} tokens. "
                f"However, you requested at least {tokens} tokens in the prompt (its media "
                f"alone expand to {tokens - len(token_ids)} or more), which leave no room to "
                f"generate within max_model_len={self.info.max_model_len}. Please reduce the "
                "length of the prompt.",
            )

    def _refuse_oversized_answer(self, params: SamplingParams, prompt_tokens: int) -> None:
        """Refuse a request whose logprobs alone would make an answer of hundreds of MB (one
        reply could take the API process's memory): ``n`` copies of a logprob entry per
        prompt token (``prompt_logprobs``) and per generated token (``logprobs``), each with
        its top-k."""
        max_tokens = params.max_tokens or self.info.max_model_len - prompt_tokens
        parts = {
            "prompt_logprobs": (prompt_tokens, params.prompt_logprobs, "prompt tokens"),
            "logprobs": (max_tokens, params.logprobs, "tokens"),
        }
        counts = {name: tokens * (k + 1) for name, (tokens, k, _) in parts.items() if k is not None}
        entries = params.n * sum(counts.values())
        limit = self.config.ar.max_answer_logprobs
        if entries <= limit:
            return
        field = max(counts, key=lambda name: counts[name])
        terms = " + ".join(
            f"{parts[name][0]} {parts[name][2]} x {parts[name][1] + 1}"  # type: ignore[operator]
            for name in counts
        )
        raise InvalidRequestError(
            field if self.params_field == "sampling_params" else f"{self.params_field}.{field}",
            f"the answer would carry {entries} logprob entries (n={params.n} x ({terms})), over "
            f"max_answer_logprobs={limit} (--max-answer-logprobs): ask for fewer samples, "
            "tokens or logprobs",
        )

    def _refuse_too_much_work(self, params: SamplingParams, prompt_tokens: int) -> None:
        """Refuse a request that would hold more than ``max_request_tokens`` tokens of the
        stage: its ``n`` samples, each its prompt and ``max_tokens`` (the rest of the
        context without it). The scheduler's fair share keeps other requests served beside
        it; this bounds how long one request may occupy its share."""
        limit = self.config.ar.max_request_tokens
        if limit is None:
            return
        max_tokens = params.max_tokens or self.info.max_model_len - prompt_tokens
        tokens = params.n * (prompt_tokens + max_tokens)
        if tokens <= limit:
            return
        field = "n" if params.n > 1 else "max_tokens"
        raise InvalidRequestError(
            field if self.params_field == "sampling_params" else f"{self.params_field}.{field}",
            f"the request would hold {tokens} tokens (n={params.n} x ({prompt_tokens} prompt "
            f"tokens + {max_tokens} max_tokens)), over max_request_tokens={limit} "
            "(--max-request-tokens): ask for fewer samples or tokens",
        )

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: Wants
    ) -> ARStageRequest:
        sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in prompt]
        if len(sources) != 1:
            raise InvalidRequestError(
                "prompt", "give exactly one of prompt, prompt_token_ids, messages"
            )
        text = prompt.get("prompt")
        self._refuse_surely_too_long(prompt, sources[0])
        media = self._media(prompt)
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
        processed = None
        if media:  # placeholders expanded, encoder inputs and positions, as the model wants
            kwargs = check_mapping(prompt.get("mm_processor_kwargs"), "mm_processor_kwargs")
            processor = self.prompt_processor()
            self._refuse_media_surely_too_long(processor, token_ids, media)
            processed = processor.process(token_ids, media, dict(kwargs))
            token_ids = processed.token_ids
        if len(token_ids) >= self.info.max_model_len:
            raise ContextLengthError(
                "prompt",
                f"This model's maximum context length is {self.info.max_model_len} tokens. "
                f"However, you requested {len(token_ids)} tokens in the prompt, which leave no "
                f"room to generate within max_model_len={self.info.max_model_len}. Please "
                "reduce the length of the prompt.",
            )
        embeds = {k: prompt[k] for k in ("prompt_embeds", "decode_embeds") if k in prompt}
        for name, value in embeds.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise InvalidRequestError(name, "must be a 2-D tensor")
            if value.shape[1] != self.info.embedding_size:
                raise InvalidRequestError(
                    name, f"rows must have {self.info.embedding_size} values, got {value.shape[1]}"
                )
        params = self.sampling_params(options)
        forced = None
        if prompt.get("forced_token_ids") is not None:
            forced = self._forced_token_ids(prompt["forced_token_ids"], len(token_ids), options)
            params = msgspec.structs.replace(params, max_tokens=len(forced))
        self._refuse_oversized_answer(params, len(token_ids))
        self._refuse_too_much_work(params, len(token_ids))
        return ARStageRequest(
            prompt_token_ids=token_ids,
            sampling_params=params,
            return_hidden_states=wants.hidden_states,
            prompt=text if isinstance(text, str) else None,
            hidden_states_with_embeddings=wants.hidden_states_with_embeddings,
            text_embeddings_only=wants.text_embeddings_only,
            hidden_layer=wants.hidden_layer,
            stream_hidden_states=wants.streamed,
            embed_token_ids=list(wants.embed_token_ids) or None,
            prompt_embeds=embeds.get("prompt_embeds"),
            token_embeds_from=prompt.get("token_embeds_from"),
            decode_embeds=embeds.get("decode_embeds"),
            multi_modal=(
                [
                    MultiModalItem(i.modality, i.offset, i.length, i.data, i.content_hash)
                    for i in processed.items
                ]
                if processed is not None
                else self._items(prompt.get("multi_modal"), len(token_ids))
            ),
            prompt_spec=(
                dict(check_mapping(prompt["prompt_spec"], "prompt_spec"))
                if prompt.get("prompt_spec") is not None
                else None
            ),
            positions=processed.positions if processed is not None else None,
            position_delta=processed.position_delta if processed is not None else 0,
            forced_token_ids=forced,
        )

    def _forced_token_ids(
        self, value: Any, prompt_tokens: int, options: RequestOptions
    ) -> list[int]:
        """The reply said rather than drawn: ids of the vocabulary, one sample, within
        ``max_model_len`` and the request's ``max_tokens``; the stage stops after the last."""
        name, vocab = "forced_token_ids", self.info.vocab_size
        ids = value if isinstance(value, list | tuple) else []
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(name, "must be a non-empty list of integers")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                name, f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        if prompt_tokens + len(value) > self.info.max_model_len:
            raise ContextLengthError(
                name,
                f"This model's maximum context length is {self.info.max_model_len} tokens. "
                f"However, you requested {prompt_tokens} tokens in the prompt and {len(value)} "
                "forced ones after it. Please reduce the length of the prompt or of the reply.",
            )
        field = self.params_field
        given = dict(check_mapping(options.params.get(field), field))
        where = "" if field == "sampling_params" else f"{field}."
        if given.get("n", 1) != 1:
            raise InvalidRequestError(f"{where}n", "a forced reply is one sample (n must be 1)")
        max_tokens = given.get("max_tokens")
        if max_tokens is not None and max_tokens < len(value):
            raise InvalidRequestError(
                f"{where}max_tokens",
                f"{max_tokens} is fewer than the {len(value)} forced_token_ids (leave it out: a "
                "forced reply ends after its last id)",
            )
        return list(value)

    def prompt_processor(self) -> PromptProcessor:
        """The model family's processor of multimodal prompts (built once, on first use)."""
        # Requests are prepared on several threads at once, and building it imports
        # transformers' lazily loaded classes, which is not thread-safe: one builds it.
        with self._build_lock:
            if self._prompt_processor is None:
                from omnistage.models import registry
                from omnistage.models.interfaces import supports_multimodal

                family = registry.family_of_folder(self.config.model)
                if not supports_multimodal(family):
                    raise InvalidRequestError(
                        "multi_modal_data", "this model takes text only (no audio, image or video)"
                    )
                self._prompt_processor = family.prompt_processor(self.config.model)
        return self._prompt_processor

    def _media(self, prompt: Mapping[str, Any]) -> list[MediaItem]:
        """The prompt's decoded media, each of a modality this stage has an encoder for."""
        value = prompt.get("multi_modal_data")
        if value is None or (isinstance(value, Mapping | list | tuple) and not value):
            if prompt.get("mm_processor_kwargs"):
                raise InvalidRequestError(
                    "mm_processor_kwargs", "is for prompts with audio, images or video"
                )
            return []
        if "multi_modal" in prompt:
            raise InvalidRequestError(
                "multi_modal_data", "give media or processed multi_modal items, not both"
            )
        items = media_items(value) if isinstance(value, Mapping) else value
        if not isinstance(items, list | tuple) or not all(isinstance(i, MediaItem) for i in items):
            raise InvalidRequestError("multi_modal_data", "must map modalities to media")
        for item in items:
            if item.modality not in self.info.multi_modal:
                taken = [m for m in self.info.multi_modal if m != "embeds"]
                raise InvalidRequestError(
                    f"multi_modal_data.{item.modality}",
                    f"this model takes no {item.modality} input"
                    + (f"; it takes {taken}" if taken else " (text only)"),
                )
        return list(items)

    def _items(self, value: Any, prompt_len: int) -> list[MultiModalItem]:
        """Multimodal items of the prompt, checked against what the stage takes."""
        from omnistage.stage.ar.multi_modal import check_items

        if value is None:
            return []
        if not isinstance(value, list | tuple) or not all(
            isinstance(i, MultiModalItem) for i in value
        ):
            raise InvalidRequestError("multi_modal", "must be a list of MultiModalItem")
        check_items(value, prompt_len, self.info.embedding_size, self.info.multi_modal)
        return list(value)

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


def _text_chars(value: Any) -> int:
    """Characters of text in a prompt, or in a message list's contents (a string, or parts of
    type ``text``; other parts are not text and are bounded elsewhere)."""
    if isinstance(value, str):
        return len(value)
    chars = 0
    for message in value if isinstance(value, list | tuple) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        for part in content if isinstance(content, list | tuple) else ():
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                chars += len(part["text"])
    return chars


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidRequestError("messages", "must be a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages.{i}", "must be an object with a string 'role'")
    return [dict(m) for m in value]
