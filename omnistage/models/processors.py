"""Stage-to-stage processors: how what one stage produced becomes the next stage's prompt.

A pipeline names one per fed stage (``input_processor``, registered in
``omnistage.models.registry``). Each says what it needs from the stage before (``wants``:
hidden states, embeddings of some token ids — asked for when the request starts, in the API
process) and turns that stage's result (``UpstreamResult``) into the next stage's prompt fields
(``convert`` — in the stage that takes them, off the API process). The generic ones live here;
a model family's with the family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnistage.errors import StageInternalError

RequestParams = Mapping[str, Mapping[str, Any]]  # the request's parameters by field name


@dataclass(frozen=True)
class Wants:
    """What the next stage needs from a stage's finished output: its hidden states (plus
    each position's input embedding), the embeddings of some token ids."""

    hidden_states: bool = False
    hidden_states_with_embeddings: bool = False
    embed_token_ids: tuple[int, ...] = ()
    # With ``hidden_states_with_embeddings``: the embeddings added at multimodal placeholders
    # are zero, not the encoders' output (only the text's embeddings are added).
    text_embeddings_only: bool = False
    # The hidden states of this layer (0: the input embeddings, i: after decoder layer i)
    # instead of the final ones; with ``hidden_states_with_embeddings`` each row is then
    # ``[input embedding | layer output]`` (side by side, not added).
    hidden_layer: int | None = None


@dataclass
class UpstreamResult:
    """A stage's finished output for one request, as the next stage's processor sees it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None
    token_embeddings: torch.Tensor | None = None  # of the ``embed_token_ids`` it was asked for
    num_prompt_tokens: int = 0
    positions: torch.Tensor | None = None  # its prompt's multimodal rotary positions [3, L]
    position_delta: int = 0  # its generated token i sat at i + position_delta
    prompt_token_ids: list[int] = field(default_factory=list)  # with its hidden states
    params: RequestParams = field(default_factory=dict)  # the request's parameters


class TokenStream(Protocol):
    """A streamed edge's input, token by token: ``feed(token_ids, final)`` takes what the
    stage before produced since the last call (``final`` with its last) and returns the ids
    the next stage takes and whether its input has ended (it may end before the stage before
    does); raises ``InvalidRequestError`` for an input the next stage cannot take."""

    def feed(self, token_ids: list[int], final: bool) -> tuple[list[int], bool]: ...


@dataclass(frozen=True)
class InputProcessor:
    """``convert(upstream, folder)``: the prompt fields of the next stage, whose checkpoint is
    ``folder``; ``wants(folder, params)``: what to ask of the stage before; ``stream(folder)``
    (None: the edge cannot stream): a ``TokenStream`` for one request, when the next stage
    takes the output while it is produced."""

    convert: Callable[[UpstreamResult, str], dict[str, Any]]
    wants: Callable[[str, RequestParams], Wants] = lambda folder, params: Wants()
    stream: Callable[[str], TokenStream] | None = None


def hidden_states_of(upstream: UpstreamResult) -> torch.Tensor:
    if upstream.hidden_states is None:
        raise StageInternalError("the upstream stage handed over no hidden_states")
    return upstream.hidden_states


HIDDEN_TO_CONDITIONING = InputProcessor(
    lambda upstream, folder: {"prompt_embeds": hidden_states_of(upstream)},
    lambda folder, params: Wants(hidden_states=True),
)
"""Condition an image decoder on the thinker's final hidden states (one row per token)."""

TEXT_TO_PROMPT = InputProcessor(lambda upstream, folder: {"prompt": upstream.text})
"""Use the upstream stage's generated text as the prompt of a text-conditioned stage."""
