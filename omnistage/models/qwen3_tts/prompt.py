"""The talker's prompt for one utterance, as the official ``qwen-tts`` package builds it: rows
that each sum a projected text token and a codec embedding (the instruction's and the role's
rows are text alone), and the text rows added to the first decode steps (the "trailing" text;
``tts_pad`` after them).

``talker_prompt`` says which ids make the rows (plain ints, checked: a bad language or voice is
a 400 naming it); ``embed_prompt`` turns them into the talker's input embeddings with the
talker's own tables, projecting the text in the reference's pieces (a projection's rounding
depends on how many rows go through it at once). Rows, in order: the instruction, the role
(``<|im_start|>assistant\n``), the codec prefix (think or nothink, the language, the speaker,
pad, each over ``tts_pad``, then ``codec_bos`` over the first text row), then the text: whole
in the prompt (``non_streaming_mode``) or its first token only, the rest trailing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen3_tts.config import AUTO_LANGUAGE, CodecIds, TextIds, TTSConfig

NONE = -1  # a row without this part
SPEAKER_VECTOR = -2  # the codec part is the request's speaker vector (a cloned voice)
ROLE_TOKENS = 3  # <|im_start|> assistant \n
END_TOKENS = 5  # <|im_end|> \n <|im_start|> assistant \n


@dataclass(frozen=True)
class TalkerPrompt:
    """One utterance's prompt, in the pieces the reference projects one call each (a
    projection's float rounding depends on how many rows go through it at once, so the pieces
    stay apart): the instruction, the role, the codec prefix, the text."""

    instruct_ids: list[int]
    role_ids: list[int]  # <|im_start|> assistant \n
    prefix: list[int]  # codec ids (SPEAKER_VECTOR: the cloned voice's row); then codec.bos
    body_ids: list[int]  # the text to speak
    non_streaming_mode: bool  # the whole text in the prompt, or one token a decode step
    text: TextIds
    codec: CodecIds

    @property
    def text_ids(self) -> list[int]:
        """Each row's text token."""
        ids = [*self.instruct_ids, *self.role_ids]
        ids += [self.text.tts_pad] * (len(self.prefix) - 1) + [self.text.tts_bos]
        if self.non_streaming_mode:
            return ids + [*self.body_ids, self.text.tts_eos, self.text.tts_pad]
        return ids + self.body_ids[:1]

    @property
    def codec_ids(self) -> list[int]:
        """Each row's codec id (NONE: a text row alone; SPEAKER_VECTOR: the cloned voice)."""
        ids = [NONE] * (len(self.instruct_ids) + len(self.role_ids)) + self.prefix
        if self.non_streaming_mode:
            return ids + [self.codec.pad] * (len(self.body_ids) + 1) + [self.codec.bos]
        return ids + [self.codec.bos]

    @property
    def trailing_ids(self) -> list[int]:
        """The text tokens added to decode steps 0, 1, ... (then tts_pad)."""
        return [] if self.non_streaming_mode else [*self.body_ids[1:], self.text.tts_eos]

    def __len__(self) -> int:
        return len(self.codec_ids)

    def spec(self) -> dict[str, Any]:
        """What a request carries (``ARStageRequest.prompt_spec``): the pieces, as plain
        values; the stage's talker knows the special ids."""
        return {
            "instruct_ids": list(self.instruct_ids),
            "role_ids": list(self.role_ids),
            "prefix": list(self.prefix),
            "body_ids": list(self.body_ids),
            "non_streaming_mode": bool(self.non_streaming_mode),
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], text: TextIds, codec: CodecIds) -> TalkerPrompt:
        """A request's ``prompt_spec`` (``InvalidRequestError`` naming a bad piece)."""
        pieces: dict[str, list[int]] = {}
        for name in ("instruct_ids", "role_ids", "prefix", "body_ids"):
            value = spec.get(name)
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise InvalidRequestError(f"prompt_spec.{name}", "must be a list of integers")
            pieces[name] = value
        if len(pieces["role_ids"]) != ROLE_TOKENS or not pieces["body_ids"] or not pieces["prefix"]:
            raise InvalidRequestError("prompt_spec", "needs a role, a codec prefix and a text")
        mode = spec.get("non_streaming_mode")
        if not isinstance(mode, bool):
            raise InvalidRequestError("prompt_spec.non_streaming_mode", "must be a boolean")
        return cls(**pieces, non_streaming_mode=mode, text=text, codec=codec)


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def language_id(config: TTSConfig, language: str, speaker: str | None) -> int | None:
    """The codec id of the language the talker is told (None: ``auto``); a dialect speaker
    speaks its dialect when the language is Chinese or left to the model."""
    name = language.lower()
    if name != AUTO_LANGUAGE and name not in config.languages:
        raise InvalidRequestError(
            "language", f"unknown language {language!r}; this model speaks {config.language_names}"
        )
    dialect = config.dialects.get(speaker.lower()) if speaker else None
    if dialect is not None and name in ("chinese", AUTO_LANGUAGE):
        return config.languages[dialect]
    return None if name == AUTO_LANGUAGE else config.languages[name]


def talker_prompt(
    config: TTSConfig,
    text_ids: Sequence[int],
    *,
    language: str = AUTO_LANGUAGE,
    speaker: str | None = None,
    speaker_vector: bool = False,
    instruct_ids: Sequence[int] | None = None,
    non_streaming_mode: bool = True,
) -> TalkerPrompt:
    """The rows of one utterance. ``text_ids``: ``assistant_text(text)`` tokenized;
    ``instruct_ids``: ``instruct_text(instruct)`` tokenized (or None); ``speaker``: a named
    voice (its codec row) unless ``speaker_vector`` (a cloned voice's x-vector row)."""
    if len(text_ids) <= ROLE_TOKENS + END_TOKENS:
        raise InvalidRequestError("input", "there is no text to speak")
    if speaker and not speaker_vector and speaker.lower() not in config.speakers:
        raise InvalidRequestError(
            "voice", f"unknown voice {speaker!r}; this model has {sorted(config.speakers)}"
        )
    codec = config.codec
    lang = language_id(config, language, speaker)
    prefix = [codec.nothink, codec.think_bos, codec.think_eos]
    if lang is not None:
        prefix = [codec.think, codec.think_bos, lang, codec.think_eos]
    if speaker_vector:
        prefix.append(SPEAKER_VECTOR)
    elif speaker:
        prefix.append(config.speakers[speaker.lower()])
    return TalkerPrompt(
        instruct_ids=list(instruct_ids or []),
        role_ids=list(text_ids[:ROLE_TOKENS]),
        prefix=[*prefix, codec.pad],  # codec.bos closes it, over the first text row
        body_ids=list(text_ids[ROLE_TOKENS:-END_TOKENS]),
        non_streaming_mode=non_streaming_mode,
        text=config.text,
        codec=codec,
    )


def embed_prompt(
    prompt: TalkerPrompt,
    embed_text: Callable[[torch.Tensor], torch.Tensor],
    embed_codec: Callable[[torch.Tensor], torch.Tensor],
    speaker_vector: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt rows [n, hidden], trailing rows [m + 1, hidden])``: each row its projected
    text token plus its codec part (an embedded codec id, or the speaker vector); the
    trailing rows end with ``tts_pad``'s, which every decode step after them takes.
    ``embed_text``: text tokens' projected embeddings; ``embed_codec``: codec ids'."""

    def text(ids: list[int]) -> torch.Tensor:
        return embed_text(torch.tensor([ids], dtype=torch.long))[0]

    tokens = prompt.text
    bos, eos, pad = text([tokens.tts_bos, tokens.tts_eos, tokens.tts_pad])
    pieces = [text(prompt.instruct_ids)] if prompt.instruct_ids else []
    pieces += [text(prompt.role_ids), pad.expand(len(prompt.prefix) - 1, -1), bos[None]]
    if prompt.non_streaming_mode:
        pieces += [text(prompt.body_ids), eos[None], pad[None]]
        trailing = pad[None]
    else:
        pieces.append(text(prompt.body_ids[:1]))
        trailing = torch.cat([text(prompt.body_ids[1:]), eos[None], pad[None]])
    rows = torch.cat(pieces)
    codec = torch.tensor(prompt.codec_ids)
    embedded = codec >= 0
    rows[embedded] = rows[embedded] + embed_codec(codec[embedded])
    cloned = codec == SPEAKER_VECTOR
    if cloned.any():
        if speaker_vector is None:
            raise InvalidRequestError("ref_audio", "a cloned voice needs its speaker embedding")
        rows[cloned] = rows[cloned] + speaker_vector.to(rows.dtype)
    return rows, trailing
