"""``RequestTable``: the requests an AR engine holds, each as its live samples.

A request with ``n`` samples arrives as ``n`` sequences: the first is prefilled, the others
wait on it (``pending_samples``) and fork from it after its prefill. Sample ``i`` draws with
its own generator seeded ``seed + i``. A sample leaves the table when it ends; the request
when its last sample does.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.tokenizer import IncrementalDetokenizer, Tokenizer
from omnistage.stage.ar.kv_cache import resolved_max_model_len
from omnistage.stage.ar.multi_modal import EMBEDS, check_items
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest, SequenceState
from omnistage.stage.ar.wire import ARStageRequest


def from_wire(request_id: str, request: object) -> ARRequest:
    """The engine request for an ``ARStageRequest`` that came over the wire."""
    if not isinstance(request, ARStageRequest):
        raise InvalidRequestError(
            "request", f"an AR stage takes 'ar' requests, got {type(request).__name__}"
        )
    return ARRequest(
        request_id,
        list(request.prompt_token_ids),
        request.sampling_params,
        request.return_hidden_states,
        request.prompt,
        request.hidden_states_with_embeddings,
        request.embed_token_ids,
        request.prompt_embeds,
        request.token_embeds_from,
        request.decode_embeds,
        list(request.multi_modal),
        request.positions,
        request.position_delta,
        request.text_embeddings_only,
        request.hidden_layer,
        request.stream_hidden_states,
        request.prompt_spec,
        list(request.forced_token_ids) if request.forced_token_ids is not None else None,
    )


def embed_prompt_spec(request: ARRequest, model: Any) -> None:
    """``request``'s ``prompt_spec`` (if it has one) made into its prompt and decode embeddings
        by ``model`` (``CausalLM.embed_prompt_spec``), a row per prompt id (``InvalidRequestError``),
    and the ids it hands the next stage before its generated ones (``context_token_ids``)."""
    if request.prompt_spec is None:
        return
    with torch.inference_mode():
        rows, trailing, context = model.embed_prompt_spec(request.prompt_spec)
    if len(rows) != len(request.prompt_token_ids):
        raise InvalidRequestError(
            "prompt_spec", f"makes {len(rows)} prompt rows for {len(request.prompt_token_ids)} ids"
        )
    request.prompt_embeds, request.decode_embeds = rows, trailing
    request.context_token_ids = list(context)
    request.prompt_spec = None


class RequestTable:
    def __init__(
        self,
        config: StageConfig,
        tokenizer: Tokenizer,
        vocab_size: int,
        device: torch.device,
        *,
        embed_dim: int = 0,
        dtype: torch.dtype = torch.float32,
        emits_text: bool = True,
        multi_modal: tuple[str, ...] = (EMBEDS,),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self.embed_dim = embed_dim  # width of input embeddings a request may bring
        self.dtype = dtype
        self.emits_text = emits_text  # False: tokens are codes, never detokenized
        self.multi_modal = multi_modal  # the modalities of the items a request may carry
        self._samples: dict[str, list[SequenceState]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def samples(self, request_id: str) -> list[SequenceState]:
        """The request's live samples (a copy: ending them changes the table)."""
        return list(self._samples.get(request_id, ()))

    def create(self, request: ARRequest) -> SequenceState:
        """Validate ``request`` and register its samples; returns the one to schedule."""
        self.validate(request)
        forced = request.forced_token_ids
        if forced is not None:  # the stage stops after the last (earlier on a stop, as drawn)
            params = request.sampling_params
            if params.max_tokens is None or params.max_tokens > len(forced):
                request.sampling_params = msgspec.structs.replace(params, max_tokens=len(forced))
        for name in ("prompt_embeds", "decode_embeds"):  # on the device, in the model's dtype
            value = getattr(request, name)
            if value is not None:
                setattr(request, name, value.to(self.device, self.dtype))
        if request.positions is not None:
            request.positions = request.positions.to(self.device)
        for item in request.multi_modal:  # the encoders' inputs, on the device
            item.data = {k: v.to(self.device) for k, v in item.data.items()}
        samples = [self._sample(request, i) for i in range(request.sampling_params.n)]
        samples[0].pending_samples = samples[1:]
        self._samples[request.request_id] = samples
        return samples[0]

    def _sample(self, request: ARRequest, index: int) -> SequenceState:
        params = request.sampling_params
        seed = params.sample_seed(index)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        detokenizer = (
            IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
            if self.emits_text
            else None
        )
        return SequenceState(request, detokenizer, generator, index)

    def forget(self, seq: SequenceState) -> None:
        samples = self._samples.get(seq.request_id)
        if samples is not None and seq in samples:
            samples.remove(seq)
            if not samples:
                del self._samples[seq.request_id]

    def validate(self, request: ARRequest) -> None:
        """``InvalidRequestError`` naming the first field the engine cannot take."""
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request.request_id in self._samples:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        params = request.sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        if params.n > self.config.ar.max_num_seqs:
            raise InvalidRequestError(
                "n", f"{params.n} samples exceed max_num_seqs={self.config.ar.max_num_seqs}"
            )
        ids = request.prompt_token_ids
        if not isinstance(ids, list | tuple) or not ids:
            raise InvalidRequestError("prompt", "must be a non-empty list of token ids")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        max_model_len = resolved_max_model_len(self.config)
        if len(ids) >= max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(ids)} tokens leave no room to generate within max_model_len={max_model_len}",
            )
        self._validate_forced(request, max_model_len)
        self._validate_embeddings(request)
        _validate_positions(request)
        check_items(request.multi_modal, len(ids), self.embed_dim, self.multi_modal)

    def _validate_forced(self, request: ARRequest, max_model_len: int) -> None:
        """``forced_token_ids``: ids of the vocabulary, one sample, room for all of them."""
        forced = request.forced_token_ids
        if forced is None:
            return
        vocab = self.vocab_size
        if not isinstance(forced, list | tuple) or not forced:
            raise InvalidRequestError("forced_token_ids", "must be a non-empty list of token ids")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in forced
        ):
            raise InvalidRequestError(
                "forced_token_ids", f"token ids must be integers in [0, {vocab})"
            )
        if request.sampling_params.n != 1:
            raise InvalidRequestError("n", "a forced reply is one sample (n must be 1)")
        total = len(request.prompt_token_ids) + len(forced)
        if total > max_model_len:
            raise InvalidRequestError(
                "forced_token_ids",
                f"{len(request.prompt_token_ids)} prompt tokens and {len(forced)} forced ones "
                f"exceed max_model_len={max_model_len}",
            )

    def _validate_embeddings(self, request: ARRequest) -> None:
        rows = {"prompt_embeds": len(request.prompt_token_ids), "decode_embeds": None}
        for name, want_rows in rows.items():
            value = getattr(request, name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise InvalidRequestError(name, "must be a float tensor")
            if value.dim() != 2 or value.shape[1] != self.embed_dim or value.shape[0] < 1:
                raise InvalidRequestError(
                    name, f"must be [rows, {self.embed_dim}], got {list(value.shape)}"
                )
            if want_rows is not None and value.shape[0] != want_rows:
                raise InvalidRequestError(
                    name, f"has {value.shape[0]} rows for {want_rows} prompt tokens"
                )
            if not torch.isfinite(value).all():
                raise InvalidRequestError(name, "holds NaN or infinite values")
        ids = request.embed_token_ids
        if ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids
        ):
            raise InvalidRequestError("embed_token_ids", f"must be ids in [0, {self.vocab_size})")


def _validate_positions(request: ARRequest) -> None:
    """Multimodal rotary positions: ``[3, prompt tokens]`` non-negative integers."""
    value, prompt_len = request.positions, len(request.prompt_token_ids)
    if not isinstance(request.position_delta, int) or isinstance(request.position_delta, bool):
        raise InvalidRequestError("position_delta", "must be an integer")
    if value is None:
        return
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.long
        or list(value.shape) != [3, prompt_len]
    ):
        raise InvalidRequestError("positions", f"must be an int64 tensor [3, {prompt_len}]")
    if bool((value < 0).any()) or prompt_len + request.position_delta < 0:
        raise InvalidRequestError("positions", "must not be negative")
