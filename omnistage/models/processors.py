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
    # Its rows as they are made (set by the router for a streamed edge): each output
    # carries its step's rows, the first also the prompt's and the token embeddings.
    streamed: bool = False


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
    context_token_ids: list[int] = field(default_factory=list)  # streamed: before token_ids
    params: RequestParams = field(default_factory=dict)  # the request's parameters


class TokenStream(Protocol):
    """A streamed edge's input, token by token: ``feed(token_ids, final)`` takes what the
    stage before produced since the last call (``final`` with its last) and returns the ids
    the next stage takes and whether its input has ended (it may end before the stage before
    does); raises ``InvalidRequestError`` for an input the next stage cannot take."""

    def feed(self, token_ids: list[int], final: bool) -> tuple[list[int], bool]: ...


class EmbedStream(Protocol):
    """A streamed edge's input into a stage that takes embeddings: ``feed_update(update,
    final)`` takes what the stage before added since the last call (its new token ids and
    hidden-state rows; the first also its prompt) and returns the next stage's fields — its
    prompt fields once they can be made, then ``{"decode_embeds": rows}`` — or None, and
    whether its input has ended."""

    def feed_update(
        self, update: UpstreamResult, final: bool
    ) -> tuple[dict[str, Any] | None, bool]: ...


@dataclass(frozen=True)
class InputProcessor:
    """``convert(upstream, folder)``: the prompt fields of the next stage, whose checkpoint is
    ``folder``; ``wants(folder, params)``: what to ask of the stage before; ``stream(folder)``
    (None: the edge cannot stream): a ``TokenStream`` for one request, when the next stage
    takes the output while it is produced."""

    convert: Callable[[UpstreamResult, str], dict[str, Any]]
    wants: Callable[[str, RequestParams], Wants] = lambda folder, params: Wants()
    stream: Callable[[str], TokenStream] | None = None
    # For a next stage that takes embeddings (an AR stage): ``stream_embeds(folder, params)``.
    stream_embeds: Callable[[str, RequestParams], EmbedStream] | None = None


class RowsStream:
    """A thinker's rows as they come, the streamed form of a hand-off ``convert`` whose
    prompt ends with the first reply token fed back and whose decode embeddings are the later
    reply tokens' rows, then two end rows (the talkers' hand-offs): the prompt fields once the
    prompt's rows and one more have come; each later row as a decode embedding
    (``decode_rows``); at the end, ``end_rows(first update)``."""

    def __init__(
        self,
        folder: str,
        params: RequestParams,
        convert: Callable[[UpstreamResult, str], dict[str, Any]],
        decode_rows: Callable[[torch.Tensor], torch.Tensor],
        end_rows: Callable[[UpstreamResult], torch.Tensor],
    ) -> None:
        self.folder, self.params = folder, params
        self.convert, self.decode_rows, self.end_rows = convert, decode_rows, end_rows
        self.first: UpstreamResult | None = None  # the prompt's: ids, embeddings, positions
        self.rows: list[torch.Tensor] = []
        self.token_ids: list[int] = []
        self.started = False

    def feed_update(
        self, update: UpstreamResult, final: bool
    ) -> tuple[dict[str, Any] | None, bool]:
        first = self.first = self.first or update
        if update.hidden_states is not None:
            self.rows.append(update.hidden_states)
        self.token_ids += update.token_ids
        if not self.started:
            if sum(len(r) for r in self.rows) <= first.num_prompt_tokens and not final:
                return None, False
            self.started = True
            fields = self.convert(self._so_far(first), self.folder)
            if not final:  # its end is not known yet: the reply's rows so far, no end rows
                fields["decode_embeds"] = fields["decode_embeds"][:-2]
                if not len(fields["decode_embeds"]):
                    del fields["decode_embeds"]
            self.rows = []
            return fields, final
        parts = [self.decode_rows(torch.cat(self.rows))] if self.rows else []
        self.rows = []
        if final:
            parts.append(self.end_rows(first).to(parts[0].dtype if parts else torch.float32))
        return ({"decode_embeds": torch.cat(parts)} if parts else None), final

    def _so_far(self, first: UpstreamResult) -> UpstreamResult:
        return UpstreamResult(
            token_ids=list(self.token_ids),
            hidden_states=torch.cat(self.rows),
            token_embeddings=first.token_embeddings,
            num_prompt_tokens=first.num_prompt_tokens,
            positions=first.positions,
            position_delta=first.position_delta,
            prompt_token_ids=first.prompt_token_ids,
            params=self.params,
        )


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
