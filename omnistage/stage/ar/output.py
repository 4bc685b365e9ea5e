"""Turns a sampled token into a ``StageOutput``: stop checks and the streamed text delta.

With stop strings the last ``len(longest stop) - 1`` characters are held back until the
generation ends, so text that a stop string later cuts away is never streamed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omnistage.stage.ar.sequence import SequenceState
from omnistage.stage.messages import TokenLogprobs
from omnistage.stage.types import FinishReason, StageOutput

if TYPE_CHECKING:
    from omnistage.stage.ar.model_runner import StepResult
    from omnistage.stage.ar.sampler import Sampled


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index of the earliest stop string in ``text`` at or after ``start``."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def append_token(
    seq: SequenceState,
    token_id: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
    logprobs: TokenLogprobs | None = None,
) -> StageOutput:
    """Add ``token_id`` to ``seq``; set ``seq.finish_reason`` when it ends; return the delta
    (with the token's logprobs entry, and the prompt's on the sample's first output)."""
    params = seq.params
    seq.token_ids.append(token_id)
    reason: FinishReason | None = None
    if token_id in params.stop_token_id_set or (
        not params.ignore_eos and token_id in eos_token_ids
    ):
        reason = "stop"
    elif seq.num_tokens >= max_model_len or (
        params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
    ):
        reason = "length"
    text = ""
    if seq.detokenizer is not None:
        text = seq.detokenizer.push([token_id])
        if reason is not None:
            text += seq.detokenizer.flush()
    previous_len = len(seq.output_text)
    seq.output_text += text
    holdback = max((len(s) for s in params.stop_strings), default=1) - 1
    if params.stop_strings and seq.num_output_tokens >= params.min_tokens:
        cut = find_stop(seq.output_text, params.stop_strings, max(0, previous_len - holdback))
        if cut is not None:
            seq.output_text = seq.output_text[:cut]
            reason = "stop"
    emit_end = len(seq.output_text) - (holdback if reason is None else 0)
    delta = seq.output_text[seq.num_emitted_chars : max(emit_end, seq.num_emitted_chars)]
    seq.num_emitted_chars += len(delta)
    seq.finish_reason = reason
    first = not seq.has_output
    prompt_logprobs = seq.prompt_logprobs if first else None
    seq.has_output = True
    return StageOutput(
        request_id=seq.request_id,
        index=seq.index,
        text_delta=delta,
        new_token_ids=[token_id],
        finished=reason is not None,
        finish_reason=reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_prompt_cached_tokens or 0,
        handoff=final_handoff(seq) if reason is not None else None,
        logprobs=[logprobs] if logprobs is not None else None,
        prompt_logprobs=prompt_logprobs,
        queue_time_s=seq.queue_time_s if first else None,
    )


def final_handoff(seq: SequenceState) -> dict[str, Any] | None:
    payload: dict[str, Any] = {}
    if seq.return_hidden_states and seq.hidden_states:
        payload["hidden_states"] = torch.cat(seq.hidden_states).cpu()
        payload["prompt_token_ids"] = seq.token_ids[: seq.num_prompt_tokens]
        if seq.positions is not None:  # the next stage continues the prompt's positions
            payload["positions"] = seq.positions.cpu()
            payload["position_delta"] = seq.position_delta
    if seq.token_embeddings is not None:
        payload["token_embeddings"] = seq.token_embeddings
    if seq.context_token_ids:
        payload["context_token_ids"] = list(seq.context_token_ids)
    return payload or None


def streamed_rows(seq: SequenceState) -> dict[str, Any] | None:
    """The hidden-state rows ``seq`` recorded since its last output said (rows a recompute
    records again were said already); the first also says its prompt, as ``final_handoff``."""
    total = sum(len(rows) for rows in seq.hidden_states)
    fresh = total - seq.num_streamed_rows
    if fresh <= 0:
        return None
    delta: dict[str, Any] = {"hidden_states": torch.cat(seq.hidden_states[-fresh:])[-fresh:].cpu()}
    if seq.num_streamed_rows == 0:
        delta.update(
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            num_prompt_tokens=seq.num_prompt_tokens,
            token_embeddings=seq.token_embeddings,
            position_delta=seq.position_delta,
        )
        if seq.positions is not None:
            delta["positions"] = seq.positions.cpu()
    seq.num_streamed_rows = total
    return delta


def abort_output(
    seq: SequenceState, reason: FinishReason = "abort", error: Exception | None = None
) -> StageOutput:
    """The final output of a sequence ended from outside (abort, error)."""
    return StageOutput(
        request_id=seq.request_id,
        index=seq.index,
        finished=True,
        finish_reason=reason,
        error=error,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
    )


@dataclass(frozen=True)
class ExecutedStep:
    """A step's model run: the batch (forks a prefill let join after their leaders), each
    one's logits row (None: its own position), the model's result, the draws and which draw
    is each drawing sequence's (batch position -> index in ``sampled``)."""

    batch: list[SequenceState]
    rows: list[int] | None
    result: StepResult
    sampled: Sampled
    drawn: dict[int, int]
    is_prefill: bool

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.result.last_hidden


def step_delta(seq: SequenceState) -> dict[str, Any] | None:
    """What a streamed edge's next stage takes from this step: the fresh hidden-state rows
    (``streamed_rows``, when the sequence streams them) and, with its first generated id, the
    context ids it takes before them (a cloned voice's reference codes)."""
    delta = streamed_rows(seq) if seq.stream_hidden_states else None
    if seq.context_token_ids and seq.num_output_tokens == 1:
        delta = {**(delta or {}), "context_token_ids": list(seq.context_token_ids)}
    return delta
