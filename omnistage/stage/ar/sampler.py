"""Picks the next token of each sequence from its logits.

Greedy rows are one batched argmax. Sampled rows go one by one so that each draws from its
own generator: a seeded request gets the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.ar.sequence import Sequence


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on one row of fp32 logits (a new tensor)."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p, as transformers and vLLM
        # do (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class Sampler:
    def __init__(self, eos_token_ids: Collection[int], generator: torch.Generator) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.generator = generator  # for requests without a seed

    def _banned_ids(self, seq: Sequence) -> list[int]:
        """Ids that may not end the sequence yet (``min_tokens``)."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        banned = set(seq.params.stop_token_id_set)
        if not seq.params.ignore_eos:
            banned.update(self.eos_token_ids)
        return sorted(banned)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        logits = logits.float()
        for i, seq in enumerate(seqs):
            banned = [t for t in self._banned_ids(seq) if t < logits.shape[-1]]
            if banned:
                logits[i, banned] = float("-inf")
        token_ids = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if not seq.params.is_greedy:
                probs = torch.softmax(filter_logits(logits[i], seq.params), dim=-1)
                generator = seq.generator if seq.generator is not None else self.generator
                token_ids[i] = int(torch.multinomial(probs, 1, generator=generator).item())
        return token_ids
