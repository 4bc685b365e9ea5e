"""Picks the next token of each sequence from its logits, and its logprobs when asked.

Greedy rows are one batched argmax. Sampled rows go one by one so that each draws from its
own generator: a seeded request gets the same tokens whatever else shares the batch.

Each row, in vLLM's order: the repetition, frequency and presence penalties (greedy rows
too), the ``min_tokens`` bans, then for sampled rows temperature, min-p, top-k and top-p. A
row's penalties come from its own sequence's prompt and output tokens only, and cost nothing
when they are off (the default).

Every combination of parameters that passes validation samples: penalised logits are clamped
to finite float32 values, filtering runs in float64 (a ``top_p`` of 1e-300 does not round to
0, a tiny temperature does not overflow), the most likely token always survives min-p and
top-p, and a row whose every token is banned keeps its bans off. Rows whose logits are not
finite (broken weights) get ``None``: the engine fails those requests, not the stage.

A sequence with ``forced_token_ids`` takes its next one instead of drawing (its generator
does not move); everything else about its step is a drawn token's: its logprobs, then the
stop checks. Ordinary rows are untouched.

Logprobs are the model's own (``log_softmax`` of the raw logits, before any processing, as
vLLM's default) or, with ``processed_logprobs``, those of the distribution the token was
drawn from (penalties, bans, temperature, min-p, top-k and top-p applied).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from omnistage.models.sampling import filter_scores
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import SequenceState

FLOAT32_MAX = torch.finfo(torch.float32).max


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int], num_prompt_tokens: int
) -> torch.Tensor:
    """The repetition, frequency and presence penalties on one row of finite float32 logits,
    given the sequence's tokens (prompt, then output); a new tensor, clamped to finite."""
    vocab_size = logits.shape[-1]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
        seen[ids] = True
        # As transformers' RepetitionPenaltyLogitsProcessor (and vLLM): away from zero.
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    output = ids[num_prompt_tokens:]
    if output.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(output, minlength=vocab_size)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0)
    # An extreme repetition penalty overflows to +-inf: clamped, the row stays samplable.
    return logits.clamp(-FLOAT32_MAX, FLOAT32_MAX)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, on one row of logits (a new float64 tensor)."""
    return filter_scores(logits, params.temperature, params.top_k, params.top_p, params.min_p)


@dataclass
class Sampled:
    """Per row: the token (``None``: non-finite logits) and, when asked, the logprob vector."""

    token_ids: list[int | None]
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)


class Sampler:
    def __init__(
        self,
        eos_token_ids: Collection[int],
        generator: torch.Generator,
        processed_logprobs: bool = False,
        suppressed: Collection[int] = (),
    ) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.generator = generator  # for requests without a seed
        self.processed_logprobs = processed_logprobs
        # Never sampled, whatever the request (a model's start code, say: its family sets them).
        self.suppressed = frozenset(suppressed)

    def _banned_ids(self, seq: SequenceState, vocab_size: int) -> list[int]:
        """Ids that may not come next: the suppressed ones, and those that would end the
        sequence before ``min_tokens``."""
        banned = set(self.suppressed)
        if seq.num_output_tokens < seq.params.min_tokens:
            banned.update(seq.params.stop_token_id_set)
            if not seq.params.ignore_eos:
                banned.update(self.eos_token_ids)
        return sorted(t for t in banned if t < vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SequenceState]) -> Sampled:
        raw = logits.float()
        finite = torch.isfinite(raw).all(dim=-1).tolist()
        processed = raw
        for i, seq in enumerate(seqs):
            penalised = finite[i] and seq.params.has_penalties
            banned = self._banned_ids(seq, raw.shape[-1])
            banned = banned if len(banned) < raw.shape[-1] else []
            if (penalised or banned) and processed is raw:
                processed = raw.clone()  # the raw logits stay as the model gave them
            if penalised:
                processed[i] = apply_penalties(
                    processed[i], seq.params, seq.token_ids, seq.num_prompt_tokens
                )
            if banned:
                processed[i, banned] = float("-inf")
        sampled = Sampled(list(processed.argmax(dim=-1).tolist()))
        for i, seq in enumerate(seqs):
            if not finite[i]:
                sampled.token_ids[i] = None
                continue
            forced = seq.forced_token
            filtered = None
            if forced is not None:  # said, not drawn: no generator moves
                sampled.token_ids[i] = forced
                wants_filtered = seq.params.logprobs is not None and self.processed_logprobs
                if wants_filtered and not seq.params.is_greedy:
                    filtered = filter_logits(processed[i], seq.params)
            elif not seq.params.is_greedy:
                filtered = filter_logits(processed[i], seq.params)
                # float32 for the draw, as before: the most likely token's probability
                # (at least 1 / vocab size) cannot underflow.
                probs = torch.softmax(filtered, dim=-1).float()
                generator = seq.generator if seq.generator is not None else self.generator
                sampled.token_ids[i] = int(torch.multinomial(probs, 1, generator=generator).item())
            if seq.params.logprobs is not None:
                source = raw[i]
                if self.processed_logprobs:
                    source = filtered if filtered is not None else processed[i]
                # In the source's precision: filtered float64 logits may exceed float32's range.
                sampled.logprobs[i] = torch.log_softmax(source, dim=-1).float()
        return sampled
