"""The talker's prompt for one utterance, as the official ``qwen-tts`` package builds it: rows
that each sum a projected text token and a codec embedding (the instruction's and the role's
rows are text alone), and the text rows added to the first decode steps (the "trailing" text;
``tts_pad`` after them).

``talker_prompt`` says which ids make the rows (plain ints, checked: a bad language or voice is
a 400 naming it); ``embed_prompt`` turns them into the talker's input embeddings with the
talker's own tables, projecting the text in the reference's pieces (a projection's rounding
depends on how many rows go through it at once). Rows, in order: the instruction, the role
(``<|im_start|>assistant\n``), the codec prefix (think or nothink, the language, the speaker
or a cloned voice's x-vector, pad, each over ``tts_pad``, then ``codec_bos`` over the first
text row), then the text: whole in the prompt (``non_streaming_mode``) or its first token only,
the rest trailing. A cloned voice in context (ICL, ``ref_frames``) ends instead as the
package's ``generate_icl_prompt``: the reference's text and the text (one projection), then
``codec_bos`` and the reference's frames (each the sum of its 16 codes' embeddings) — after the
text over ``codec_pad`` (whole), or beside it row by row (streaming: the text left over
trails).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen3_tts.config import AUTO_LANGUAGE, CodecIds, TextIds, TTSConfig

NONE = -1  # a row without this part
SPEAKER_VECTOR = -2  # the codec part is the request's speaker vector (a cloned voice)
REF_FRAME = -3  # the codec part is a reference frame's summed code embeddings (ICL)
ROLE_TOKENS = 3  # <|im_start|> assistant \n
END_TOKENS = 5  # <|im_end|> \n <|im_start|> assistant \n
REF_END_TOKENS = 2  # <|im_end|> \n (a reference's text)


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
    ref_ids: list[int] = dataclasses.field(default_factory=list)  # ICL: the reference's text
    ref_frames: int = 0  # ICL: the reference's frames (0: no ICL)

    @property
    def icl_text(self) -> list[int]:
        """ICL's text rows: the reference's text, the text, ``tts_eos``."""
        return [*self.ref_ids, *self.body_ids, self.text.tts_eos]

    @property
    def text_ids(self) -> list[int]:
        """Each row's text token."""
        ids = [*self.instruct_ids, *self.role_ids]
        ids += [self.text.tts_pad] * (len(self.prefix) - 1) + [self.text.tts_bos]
        if self.ref_frames:
            text, codec = self.icl_text, self.ref_frames + 1
            if self.non_streaming_mode:
                return ids + text + [self.text.tts_pad] * codec
            return ids + (text + [self.text.tts_pad] * codec)[:codec]
        if self.non_streaming_mode:
            return ids + [*self.body_ids, self.text.tts_eos, self.text.tts_pad]
        return ids + self.body_ids[:1]

    @property
    def codec_ids(self) -> list[int]:
        """Each row's codec id (NONE: a text row alone; SPEAKER_VECTOR: the cloned voice;
        REF_FRAME: a reference frame)."""
        ids = [NONE] * (len(self.instruct_ids) + len(self.role_ids)) + self.prefix
        if self.ref_frames:
            frames = [self.codec.bos] + [REF_FRAME] * self.ref_frames
            if self.non_streaming_mode:
                return ids + [self.codec.pad] * len(self.icl_text) + frames
            return ids + frames
        if self.non_streaming_mode:
            return ids + [self.codec.pad] * (len(self.body_ids) + 1) + [self.codec.bos]
        return ids + [self.codec.bos]

    @property
    def trailing_ids(self) -> list[int]:
        """The text tokens added to decode steps 0, 1, ... (then tts_pad)."""
        if self.ref_frames:
            return [] if self.non_streaming_mode else self.icl_text[self.ref_frames + 1 :]
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
            "ref_ids": list(self.ref_ids),
            "ref_frames": int(self.ref_frames),
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], text: TextIds, codec: CodecIds) -> TalkerPrompt:
        """A request's ``prompt_spec`` (``InvalidRequestError`` naming a bad piece)."""
        pieces: dict[str, list[int]] = {}
        for name in ("instruct_ids", "role_ids", "prefix", "body_ids", "ref_ids"):
            value = spec.get(name, [] if name == "ref_ids" else None)
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
        frames = spec.get("ref_frames", 0)
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
            raise InvalidRequestError("prompt_spec.ref_frames", "must be an integer >= 0")
        if bool(frames) != bool(pieces["ref_ids"]):
            raise InvalidRequestError("prompt_spec", "a reference's frames go with its text")
        return cls(**pieces, non_streaming_mode=mode, text=text, codec=codec, ref_frames=frames)


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text(text: str) -> str:
    """A cloned voice's reference text, as the package wraps it (``_build_ref_text``)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


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
    ref_ids: Sequence[int] | None = None,
    ref_frames: int = 0,
) -> TalkerPrompt:
    """The rows of one utterance. ``text_ids``: ``assistant_text(text)`` tokenized;
    ``instruct_ids``: ``instruct_text(instruct)`` tokenized (or None); ``speaker``: a named
    voice (its codec row) unless ``speaker_vector`` (a cloned voice's x-vector row);
    ``ref_ids``: ``ref_text(text)`` tokenized and ``ref_frames`` its clip's frames, for a
    cloned voice in context (ICL)."""
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
        ref_ids=list(ref_ids[ROLE_TOKENS:-REF_END_TOKENS]) if ref_frames and ref_ids else [],
        ref_frames=ref_frames,
    )


def embed_prompt(
    prompt: TalkerPrompt,
    embed_text: Callable[[torch.Tensor], torch.Tensor],
    embed_codec: Callable[[torch.Tensor], torch.Tensor],
    speaker_vector: torch.Tensor | None = None,
    ref_frames: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt rows [n, hidden], trailing rows [m + 1, hidden])``: each row its projected
    text token plus its codec part (an embedded codec id, the speaker vector, or a reference
    frame's summed embeddings, ``ref_frames`` ``[frames, hidden]``); the trailing rows end
    with ``tts_pad``'s, which every decode step after them takes. ``embed_text``: text tokens'
    projected embeddings; ``embed_codec``: codec ids'."""

    def text(ids: list[int]) -> torch.Tensor:
        return embed_text(torch.tensor([ids], dtype=torch.long))[0]

    tokens = prompt.text
    bos, eos, pad = text([tokens.tts_bos, tokens.tts_eos, tokens.tts_pad])
    pieces = [text(prompt.instruct_ids)] if prompt.instruct_ids else []
    pieces += [text(prompt.role_ids), pad.expand(len(prompt.prefix) - 1, -1), bos[None]]
    if prompt.ref_frames:  # generate_icl_prompt: the reference's text and the text at once
        icl = torch.cat([text([*prompt.ref_ids, *prompt.body_ids]), eos[None]])
        codec_rows = prompt.ref_frames + 1
        if prompt.non_streaming_mode:
            pieces += [icl, pad.expand(codec_rows, -1)]
            trailing = pad[None]
        elif len(icl) > codec_rows:
            pieces.append(icl[:codec_rows])
            trailing = torch.cat([icl[codec_rows:], pad[None]])
        else:
            pieces += [icl, pad.expand(codec_rows - len(icl), -1)]
            trailing = pad[None]
    elif prompt.non_streaming_mode:
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
    framed = codec == REF_FRAME
    if framed.any():
        if ref_frames is None or len(ref_frames) != int(framed.sum()):
            raise InvalidRequestError(
                "ref_audio", f"the prompt has {int(framed.sum())} reference frames, the clip "
                f"{0 if ref_frames is None else len(ref_frames)}"
            )  # fmt: skip
        rows[framed] = rows[framed] + ref_frames.to(rows.dtype)
    return rows, trailing
