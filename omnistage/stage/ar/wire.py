"""What crosses the wire for an AR stage: its request and what it reports at start-up.

Light (msgspec, torch tensors as data): the API process imports this, never the engine.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.ar.sampling_params import SamplingParams

KIND = "ar"


class MultiModalItem(msgspec.Struct, forbid_unknown_fields=True):
    """One non-text input of a prompt, as the model's encoder takes it.

    ``modality`` names the encoder ("audio", "image", "video"; "embeds" for embeddings computed
    elsewhere, taken as they are); its placeholder tokens sit at ``offset`` .. ``offset +
    length`` of the prompt, and the encoder's output replaces their embeddings. ``data`` holds
    the processed input (tensors by name: features, pixel patches, or ``embeds`` ``[length,
    hidden]``); ``content_hash`` names the raw input, so the prefix cache never reuses the k/v
    of one picture for another that sits behind the same placeholder ids."""

    modality: str
    offset: int
    length: int
    data: dict[str, torch.Tensor] = {}
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.modality, str) or not self.modality:
            raise InvalidRequestError("multi_modal.modality", "must be a non-empty string")
        if self.offset < 0 or self.length < 1:
            raise InvalidRequestError(
                "multi_modal", f"placeholder range [{self.offset}, +{self.length}) is empty"
            )


class ARStageRequest(msgspec.Struct, tag=KIND, forbid_unknown_fields=True):
    """A tokenized prompt for an AR stage. ``prompt`` is the text, for the record only.

    For a stage fed by another: ``prompt_embeds`` ``[L, E]`` are the prompt's input embeddings
    (the ids then count only for lengths and penalties; positions from ``token_embeds_from``
    on add their token's embedding too) and ``decode_embeds`` ``[R, E]`` are added to the
    embedding of the token fed at decode step ``j`` (row ``min(j, R - 1)``). For a stage
    feeding one: ``hidden_states_with_embeddings`` returns each position's final hidden state
    plus its input embedding, and ``embed_token_ids`` asks for those ids' embeddings
    (``token_embeddings`` in what it hands over). ``multi_modal`` items replace the
    embeddings of their placeholder positions with their encoder's output. ``positions``
    ``[3, L]`` are the prompt's multimodal rotary positions (time, height, width) for a model
    that has them; generated token ``i`` then sits at ``i + position_delta`` in all three.
    ``forced_token_ids``: the reply, said rather than drawn — each step's token is the next
    of them (computed, fed back and stopped on as a drawn one), and the stage stops after the
    last (``sampler.py``)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_hidden_states: bool = False
    prompt: str | None = None
    hidden_states_with_embeddings: bool = False
    text_embeddings_only: bool = False  # ... but zeros at multimodal placeholders
    hidden_layer: int | None = None  # that layer's hidden states (see ``Wants``)
    stream_hidden_states: bool = False  # each output carries its step's rows (``Wants``)
    embed_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None
    token_embeds_from: int | None = None  # prompt positions from here add their tokens' too
    decode_embeds: torch.Tensor | None = None
    multi_modal: list[MultiModalItem] = []
    positions: torch.Tensor | None = None
    position_delta: int = 0
    # A prompt the model builds its own input embeddings for (``CausalLM.embed_prompt_spec``;
    # a speech model's prompt rows): ``prompt_embeds`` and ``decode_embeds`` come from it.
    prompt_spec: dict[str, Any] | None = None
    forced_token_ids: list[int] | None = None


class ARStageInfo(msgspec.Struct, tag=KIND):
    """What the API process needs to validate requests for an AR stage, as the stage's model
    family sets it up: the request field its sampling parameters come from
    (``params_field``), the defaults under the user's (``param_defaults``), the stop ids it
    always adds, and the modalities its encoders take."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int = 1
    embedding_size: int = 0  # width of input embeddings a request may bring
    emits_text: bool = True  # False: its tokens are codes (a speech-token stage)
    params_field: str = "sampling_params"
    param_defaults: dict[str, Any] = {}
    stop_token_ids: list[int] = []
    multi_modal: list[str] = []


# What the kinds map reads of this kind (``omnistage.stage.kinds``).
REQUEST, INFO, OUTPUT = ARStageRequest, ARStageInfo, None

__all__ = ["KIND", "ARStageInfo", "ARStageRequest", "MultiModalItem", "SamplingParams"]
