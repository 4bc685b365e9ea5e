"""Logprob entries in vLLM's shape: per position, the chosen token's logprob and rank, plus
the top k (``TokenLogprobs``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnistage.stage.messages import TokenLogprobs

# Prompt rows are turned into logprobs this many at a time: a [rows, vocab] float32 block.
_PROMPT_ROWS_PER_CHUNK = 256

Decode = Callable[[int], str]


def position_logprobs(
    logprobs: torch.Tensor, token_id: int, k: int, decode: Decode
) -> TokenLogprobs:
    """The entry for ``token_id`` given one position's logprob vector ``[vocab]``."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum().item()) + 1
    token_ids, values, ranks = [token_id], [float(chosen.item())], [rank]
    if k:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        token_ids += top.indices.tolist()
        values += top.values.tolist()
        ranks += list(range(1, len(top.indices) + 1))
    return TokenLogprobs(token_ids, values, ranks, [decode(t) for t in token_ids])


def prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: list[int], k: int, decode: Decode
) -> list[TokenLogprobs | None]:
    """One entry per prompt token (``None`` for the first, which nothing predicts), from the
    logits of every prompt position ``[len(prompt), vocab]`` (raw: as vLLM)."""
    entries: list[TokenLogprobs | None] = [None]
    for start in range(0, len(prompt_token_ids) - 1, _PROMPT_ROWS_PER_CHUNK):
        end = min(start + _PROMPT_ROWS_PER_CHUNK, len(prompt_token_ids) - 1)
        rows = torch.log_softmax(logits[start:end].float(), dim=-1)
        for j in range(end - start):
            entries.append(position_logprobs(rows[j], prompt_token_ids[start + j + 1], k, decode))
    return entries


@dataclass(frozen=True)
class Logprob:
    """One token's logprob at a position (vLLM's ``Logprob``): ``rank`` 1 is the most likely."""

    logprob: float
    rank: int
    decoded_token: str


def as_dict(entry: TokenLogprobs) -> dict[int, Logprob]:
    """A position's entry as vLLM gives it: token id -> ``Logprob``, the chosen token first."""
    return {
        token_id: Logprob(logprob, rank, text)
        for token_id, logprob, rank, text in zip(
            entry.token_ids, entry.logprobs, entry.ranks, entry.tokens, strict=True
        )
    }
