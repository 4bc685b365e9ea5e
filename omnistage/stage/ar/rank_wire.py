"""Messages between rank 0 of a tensor-parallel AR stage and its ranks 1..N-1.

Rank 0 sends each step's batch (``RankStep``: what the model runner reads of each sequence),
KV block copies, embedding lookups (every rank takes part in the collective) and control
operations — the same typed structs as the stage channel (``omnistage.stage.control``) — and
each rank answers control with its own ACK, or its error as data. msgpack like the stage
channel, tensors included.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import torch

from omnistage.stage.ar.sequence import SequenceState
from omnistage.stage.ar.tp_weights import SyncSlice
from omnistage.stage.ar.wire import MultiModalItem
from omnistage.stage.control import Ack, ControlOp
from omnistage.stage.messages import WireError, decoder, encode


class SeqView(msgspec.Struct):
    """What the model runner reads of a sequence, for the ranks that do not schedule."""

    token_ids: list[int]
    num_tokens: int
    num_cached_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    has_input_embeds: bool
    hidden_states_with_embeddings: bool
    return_hidden_states: bool
    prompt_embeds: torch.Tensor | None = None
    token_embeds_from: int | None = None
    decode_embeds: torch.Tensor | None = None
    multi_modal: list[MultiModalItem] = []
    wants_prompt_logits: bool = False
    positions: torch.Tensor | None = None
    position_delta: int = 0
    text_embeddings_only: bool = False
    hidden_layer: int | None = None

    @property
    def params(self) -> Any:
        # The runner asks ``params.prompt_logprobs`` and ``prompt_logprobs`` for the same
        # decision rank 0 makes: computing prompt logits is a collective.
        return SimpleNamespace(prompt_logprobs=0 if self.wants_prompt_logits else None)

    @property
    def prompt_logprobs(self) -> None:
        return None

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @classmethod
    def of(cls, seq: SequenceState, is_prefill: bool) -> SeqView:
        return cls(
            # A decode step reads only the last token; a prefill its tokens from the cache on.
            token_ids=list(seq.token_ids) if is_prefill else [seq.last_token_id],
            num_tokens=seq.num_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            block_table=list(seq.block_table),
            num_prompt_tokens=seq.num_prompt_tokens,
            has_input_embeds=seq.has_input_embeds,
            hidden_states_with_embeddings=seq.hidden_states_with_embeddings,
            return_hidden_states=seq.return_hidden_states,
            prompt_embeds=seq.prompt_embeds,
            token_embeds_from=seq.token_embeds_from,
            decode_embeds=seq.decode_embeds,
            multi_modal=list(seq.multi_modal) if is_prefill else [],
            positions=seq.positions if is_prefill else None,
            position_delta=seq.position_delta,
            text_embeddings_only=seq.text_embeddings_only,
            hidden_layer=seq.hidden_layer,
            wants_prompt_logits=is_prefill
            and seq.params.prompt_logprobs is not None
            and seq.prompt_logprobs is None,
        )


class RankStep(msgspec.Struct, tag=True):
    seqs: list[SeqView]
    is_prefill: bool


class RankEmbed(msgspec.Struct, tag=True):
    token_ids: list[int]


class RankCopyKV(msgspec.Struct, tag=True):
    src: int
    dst: int


class RankControl(msgspec.Struct, tag=True):
    op: ControlOp


class RankShutdown(msgspec.Struct, tag=True):
    pass


class RankSyncPrepare(msgspec.Struct, tag=True):
    """A trainer's update, staged whole on rank 0: take your slices (``tp_weights``)."""

    slices: list[SyncSlice]


class RankSyncCommit(msgspec.Struct, tag=True):
    """Apply the prepared slices as ``version`` (``apply``), or drop them."""

    version: str
    apply: bool


ToRank = (
    RankStep
    | RankEmbed
    | RankCopyKV
    | RankControl
    | RankShutdown
    | RankSyncPrepare
    | RankSyncCommit
)


class RankReady(msgspec.Struct, tag=True):
    rank: int
    num_kv_blocks: int


class RankFailed(msgspec.Struct, tag=True):
    rank: int
    error: str


class RankReply(msgspec.Struct, tag=True):
    """A rank's answer to a ``RankControl``: its ACK (None for an operation without one) or
    its error."""

    rank: int
    ack: Ack | None = None
    error: WireError | None = None


FromRank = RankReady | RankFailed | RankReply

_to_rank = decoder(ToRank)
_from_rank = decoder(FromRank)


def decode_to_rank(data: bytes) -> ToRank:
    return _to_rank.decode(data)


def decode_from_rank(data: bytes) -> FromRank:
    return _from_rank.decode(data)


__all__ = ["FromRank", "RankControl", "SeqView", "ToRank", "decode_from_rank", "encode"]
