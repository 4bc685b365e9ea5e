"""Collecting a request's outputs into OpenAI choices (one per sample), and the logprobs
shapes of the two APIs: chat's ``{"content": [...]}`` and completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, plus vLLM's
``prompt_logprobs`` (token id -> ``{logprob, rank, decoded_token}``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.engine.outputs import OmniAudio, OmniImage, OmniRequestOutput
from omnistage.entrypoints.openai.replies import PromptTokensDetails, Usage
from omnistage.stage.messages import TokenLogprobs


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def as_token_ids(entries: list[Any]) -> list[Any]:
    """Entries whose token texts are ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)."""
    return [
        None
        if e is None
        else TokenLogprobs(e.token_ids, e.logprobs, e.ranks, [f"token_id:{t}" for t in e.token_ids])
        for e in entries
    ]


def chat_logprobs(entries: list[TokenLogprobs]) -> dict[str, Any]:
    """Chat's shape: per token, the chosen one and its ``top_logprobs``."""
    return {
        "content": [
            {
                "token": e.tokens[0],
                "logprob": e.logprobs[0],
                "bytes": _bytes(e.tokens[0]),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": _bytes(t)}
                    for t, lp in zip(e.tokens[1:], e.logprobs[1:], strict=True)
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprobs | None], text_offset: int = 0
) -> dict[str, Any]:
    """Completions' shape; ``None`` entries (an echoed prompt's first token) stay null."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        if entry is None:
            tokens.append("")
            token_logprobs.append(None)
            top.append(None)
        else:
            tokens.append(entry.tokens[0])
            token_logprobs.append(entry.logprobs[0])
            top.append(dict(zip(entry.tokens, entry.logprobs, strict=True)))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs_json(entries: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, token id -> logprob, rank, text."""
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": text}
            for token_id, logprob, rank, text in zip(
                entry.token_ids, entry.logprobs, entry.ranks, entry.tokens, strict=True
            )
        }
        for entry in entries
    ]


@dataclass
class Choice:
    """One sample's text (and its token ids), images, logprobs and end, as they came."""

    index: int
    text: str = ""
    images: list[OmniImage] = field(default_factory=list)
    audio: list[OmniAudio] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


class Collected:
    """Every sample of a request, in index order, and the request's usage."""

    def __init__(self) -> None:
        self.by_index: dict[int, Choice] = {}
        self.num_prompt_tokens = 0
        self.num_cached_tokens: int | None = None  # known once a text stage finished

    def choice(self, index: int) -> Choice:
        if index not in self.by_index:
            self.by_index[index] = Choice(index)
        return self.by_index[index]

    def add(self, out: OmniRequestOutput) -> None:
        choice = self.choice(out.index)
        if out.modality == "text":
            choice.text += out.text_delta
            choice.token_ids += out.new_token_ids
            choice.logprobs += out.logprobs or []
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                choice.finish_reason = out.finish_reason
                choice.num_output_tokens = out.num_output_tokens
                self.num_prompt_tokens = out.num_prompt_tokens
                self.num_cached_tokens = out.num_cached_tokens
        choice.images.extend(out.images)
        choice.audio.extend(out.audio)
        # A text+image answer ends as its text did ("length" if the text hit max_tokens),
        # unless the request as a whole was aborted or failed.
        if out.final and (choice.finish_reason is None or out.finish_reason in ("abort", "error")):
            choice.finish_reason = out.finish_reason

    @property
    def choices(self) -> list[Choice]:
        return [self.by_index[i] for i in sorted(self.by_index)] or [Choice(0)]

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def usage(self) -> Usage:
        completion = sum(c.num_output_tokens for c in self.by_index.values())
        cached = self.num_cached_tokens
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=None
            if cached is None
            else PromptTokensDetails(cached_tokens=cached),
        )
