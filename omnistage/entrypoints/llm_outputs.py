"""What the offline ``LLM`` answers, in vLLM's shapes: a ``RequestOutput`` per prompt with a
``CompletionOutput`` per sample, and logprobs as, per token, token id -> ``Logprob``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.stage.ar.logprobs import Logprob, as_dict
from omnistage.stage.types import StageOutput


@dataclass
class CompletionOutput:
    """One sample: its text, tokens, and — when asked — per token, token id -> ``Logprob``
    (the sampled token and the top ``logprobs``), as vLLM's."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    hidden_states: torch.Tensor | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs (None without ``logprobs``)."""
        if self.logprobs is None:
            return None
        return sum(entry[t].logprob for t, entry in zip(self.token_ids, self.logprobs, strict=True))


@dataclass
class RequestOutput:
    """One prompt's answer: its ``n`` samples in index order, and — with ``prompt_logprobs``
    — per prompt token its entry (``None`` for the first, which nothing predicts)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def add_output(result: RequestOutput, out: StageOutput) -> bool:
    """Add one engine output to its sample of ``result``; whether it ended the sample."""
    sample = result.outputs[out.index]
    sample.text += out.text_delta
    sample.token_ids += out.new_token_ids
    if out.logprobs is not None:
        sample.logprobs = (sample.logprobs or []) + [as_dict(e) for e in out.logprobs]
    if out.prompt_logprobs is not None and result.prompt_logprobs is None:
        result.prompt_logprobs = [None if e is None else as_dict(e) for e in out.prompt_logprobs]
    if not out.finished:
        return False
    sample.finish_reason = out.finish_reason
    if out.handoff is not None:
        sample.hidden_states = out.handoff.get("hidden_states")
    return True
