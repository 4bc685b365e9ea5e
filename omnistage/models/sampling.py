"""Transformers' sampling warpers on one row of logits, shared by the AR stage's sampler and
the model families that draw codes of their own (a code predictor's 15 codes per frame)."""

from __future__ import annotations

import torch


def filter_scores(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """``filter_logits`` from its settings: transformers' warpers in their order, the dropped
    tokens at ``-inf`` (a new float64 row, the vocabulary's order kept, so that a draw over it
    consumes the generator as transformers' ``multinomial`` over the whole row does)."""
    logits = logits.double() / temperature
    if min_p > 0.0:
        # Relative to the most likely token, which always stays (as vLLM, before top-k/p).
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p, as transformers and vLLM
        # do; the first always stays, however small top_p is.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits
