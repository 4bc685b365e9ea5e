"""Qwen3-Omni's hand-offs: thinker → talker → code2wav, as transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` chains them.

The thinker hands over, per position it processed (the prompt and every generated token but
the last), its input embedding (zero at multimodal placeholders) beside its hidden state
after layer ``accept_hidden_layer``, and the embeddings of the tts bos / eos / pad tokens.
The talker's prompt is then, in the thinker's width plus a flag column (1: project the row
with ``hidden_projection``, 0: with ``text_projection``; ``talker.Talker.project_embeds``):

- every position of the user turns (a multimodal one's hidden state, flagged; a text one's
  embedding), in order;
- the assistant turn's first three positions (``<|im_start|>assistant\\n``), four tts pads,
  the tts bos and the first reply token, whose last six add the codec embeddings of
  [nothink, think bos, think eos, the voice, codec pad, codec bos];

and each decode step adds the next reply token's embedding, then the tts eos, then tts pad for
as long as the talker speaks. The talker's codes go to code2wav as whole frames, frame-major
and flat, up to (without) its codec end.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnistage.errors import InvalidRequestError, StageInternalError
from omnistage.models.processors import (
    InputProcessor,
    RequestParams,
    RowsStream,
    UpstreamResult,
    Wants,
    hidden_states_of,
)
from omnistage.models.qwen3_omni.config import CHECKPOINT, OmniTokens
from omnistage.models.qwen3_omni.talker import TalkerTokens

VOICE_FIELD = "audio_params"  # where a request names its voice (the code2wav stage's params)
DEFAULT_VOICE = "ethan"  # transformers' generate default speaker
ASSISTANT_HEAD = 3  # <|im_start|> assistant \n
TTS_PADS = 4


@functools.lru_cache(maxsize=8)
def checkpoint_tokens(folder: str) -> tuple[OmniTokens, TalkerTokens]:
    raw = CHECKPOINT.config(folder, StageInternalError)
    return OmniTokens.from_config(raw), TalkerTokens.from_config(raw)


def chosen_voice(params: RequestParams, voices: dict[str, int]) -> str:
    voice = str((params.get(VOICE_FIELD) or {}).get("voice") or "").lower()
    if not voice:
        voice = DEFAULT_VOICE if DEFAULT_VOICE in voices else sorted(voices)[0]
    if voice not in voices:
        raise InvalidRequestError(
            f"{VOICE_FIELD}.voice", f"unknown voice {voice!r}; this model has {sorted(voices)}"
        )
    return voice


def talker_wants(folder: str, params: RequestParams) -> Wants:
    omni, talker = checkpoint_tokens(folder)
    chosen_voice(params, talker.voices)  # refused before the thinker runs
    return Wants(
        hidden_states=True,
        hidden_states_with_embeddings=True,
        text_embeddings_only=True,
        hidden_layer=talker.accept_hidden_layer,
        embed_token_ids=(omni.tts_bos, omni.tts_eos, omni.tts_pad),
    )


def _user_positions(ids: list[int], omni: OmniTokens) -> list[int]:
    """Positions whose turn (the token after the latest ``<|im_start|>``) is the user's."""
    out, role = [], ids[1] if len(ids) > 1 else None
    for i, token in enumerate(ids):
        if token == omni.im_start:
            role = ids[i + 1] if i + 1 < len(ids) else None
        if role == omni.user:
            out.append(i)
    return out


def _assistant_start(ids: list[int], omni: OmniTokens) -> int:
    starts = [
        i for i in range(len(ids) - 1) if ids[i] == omni.im_start and ids[i + 1] == omni.assistant
    ]
    if not starts:
        raise InvalidRequestError("messages", "speech needs a prompt that opens an assistant turn")
    return starts[-1]


def thinker_to_talker(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    omni, talker = checkpoint_tokens(folder)
    rows = hidden_states_of(upstream)
    if upstream.token_embeddings is None or len(upstream.token_embeddings) != 3:
        raise StageInternalError("the thinker handed over no tts bos/eos/pad embeddings")
    width = rows.shape[1] // 2
    embeds, hidden = rows[:, :width], rows[:, width:]
    bos, eos, pad = upstream.token_embeddings.to(rows.dtype)
    prompt = list(upstream.prompt_token_ids)
    if len(prompt) != upstream.num_prompt_tokens:
        raise StageInternalError("the thinker handed over no prompt ids")
    multimodal = {omni.audio, omni.image, omni.video}

    def text(values: torch.Tensor) -> torch.Tensor:  # rows projected as text (flag 0)
        return torch.cat([values, values.new_zeros(len(values), 1)], dim=1)

    user = _user_positions(prompt, omni)
    flagged = torch.tensor([prompt[i] in multimodal for i in user], dtype=torch.bool)
    user_rows = text(embeds[user])
    if flagged.any():
        index = torch.tensor(user, dtype=torch.long)[flagged]
        user_rows[flagged] = torch.cat([hidden[index], hidden.new_ones(len(index), 1)], dim=1)
    start = _assistant_start(prompt, omni)
    assistant = embeds[start:]  # its head, then each reply token fed back
    reply = assistant[ASSISTANT_HEAD:]
    if len(reply) == 0:  # a one-token reply: its end is all there is to say
        reply = eos[None]
    head = torch.cat([assistant[:ASSISTANT_HEAD], pad.expand(TTS_PADS, -1), bos[None], reply[:1]])
    decode = torch.cat([reply[1:], eos[None], pad[None]])
    voice = talker.voices[chosen_voice(upstream.params, talker.voices)]
    codec = [talker.nothink, talker.think_bos, talker.think_eos, voice, talker.pad, talker.bos]
    # positions without a codec embedding take the codec pad: a suppressed id, which the
    # repetition penalty over the prompt therefore never touches
    ids = [talker.pad] * (len(user) + ASSISTANT_HEAD) + codec
    fields: dict[str, Any] = {
        "prompt_token_ids": ids,
        "prompt_embeds": torch.cat([user_rows, text(head)]),
        "token_embeds_from": len(user) + ASSISTANT_HEAD,
        "decode_embeds": text(decode),
    }
    if upstream.positions is not None:  # a multimodal prompt: 3-D positions
        positions = talker_positions(upstream.positions, user, len(head))
        fields["positions"] = positions
        fields["position_delta"] = int(positions.max()) + 1 - positions.shape[1]
    return fields


def talker_positions(thinker: torch.Tensor, user: list[int], tail: int) -> torch.Tensor:
    """The talker prompt's 3-D positions, as transformers' ``get_rope_index`` numbers its ids
    (the user turns' tokens, then ``tail`` text positions): each run of consecutive user
    positions keeps the thinker's positions relative to its first (a text token:
    ``<|im_start|>``), starting one past the largest position before it."""
    runs: list[torch.Tensor] = []
    following = 0
    i = 0
    while i < len(user):
        j = i
        while j + 1 < len(user) and user[j + 1] == user[j] + 1:
            j += 1
        run = thinker[:, user[i] : user[j] + 1]
        run = run - run[:, :1] + following
        runs.append(run)
        following = int(run.max()) + 1
        i = j + 1
    runs.append(torch.arange(following, following + tail, dtype=torch.long).expand(3, -1))
    return torch.cat(runs, dim=1)


def whole_frames(codes: list[int], groups: int, end: int) -> tuple[list[int], bool]:
    """Whole frames of ``codes`` up to the end code; whether it was reached."""
    out: list[int] = []
    for i in range(0, len(codes), groups):
        frame = codes[i : i + groups]
        if frame[0] == end:
            return out, True
        if len(frame) < groups:  # the step that ended on its length predicts no frame
            break
        out += frame
    return out, False


def talker_to_code2wav(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    _, talker = checkpoint_tokens(folder)
    codes, _ = whole_frames(list(upstream.token_ids), talker.groups, talker.eos)
    if not codes:
        raise InvalidRequestError("talker_params", "the talker produced no speech codes")
    return {"codes": codes}


class CodecFrames:
    """A talker's frames of ``groups`` codes as they come (flat, whole frames only), up to its
    codec ``end``: the streamed form of a talker -> code2wav hand-off (no codes at all is an
    ``InvalidRequestError`` naming ``field``); a clone's reference frames first
    (``feed_update``)."""

    def __init__(self, groups: int, end: int, field: str) -> None:
        self.groups, self.end, self.field = groups, end, field
        self.pending: list[int] = []
        self.num_codes = 0
        self.ended = False

    def feed(self, token_ids: list[int], final: bool) -> tuple[list[int], bool]:
        if self.ended:
            return [], True
        self.pending += token_ids
        whole = len(self.pending) - len(self.pending) % self.groups
        codes, reached = whole_frames(self.pending[:whole], self.groups, self.end)
        if not reached and whole < len(self.pending) and self.pending[whole] == self.end:
            reached = True
        self.pending = [] if reached else self.pending[whole:]
        self.num_codes += len(codes)
        self.ended = final or reached
        if self.ended and self.num_codes == 0:
            raise InvalidRequestError(self.field, "the talker produced no speech codes")
        return codes, self.ended

    def feed_update(self, update: UpstreamResult, final: bool) -> tuple[list[int], bool]:
        """``feed`` of an update, after the ids it says come first (``context_token_ids``: a
        cloned voice's reference frames, on the talker's first output)."""
        codes, ended = self.feed(list(update.token_ids), final)
        return list(update.context_token_ids) + codes, ended


class TalkerFrames(CodecFrames):
    """Qwen3-Omni's talker's frames as they come: the streamed form of ``talker_to_code2wav``."""

    def __init__(self, folder: str) -> None:
        _, talker = checkpoint_tokens(folder)
        super().__init__(talker.groups, talker.eos, "talker_params")


def _decode_rows(rows: torch.Tensor) -> torch.Tensor:
    """Reply tokens' rows as the talker's decode embeddings: their embeddings, as text."""
    embeds = rows[:, : rows.shape[1] // 2]
    return torch.cat([embeds, embeds.new_zeros(len(embeds), 1)], dim=1)


def _end_rows(first: UpstreamResult) -> torch.Tensor:
    """After the reply: the tts eos, then tts pad (repeating), as text."""
    assert first.token_embeddings is not None
    _, eos, pad = first.token_embeddings
    end = torch.stack([eos, pad])
    return torch.cat([end, end.new_zeros(2, 1)], dim=1)


def thinker_rows(folder: str, params: RequestParams) -> RowsStream:
    return RowsStream(folder, params, thinker_to_talker, _decode_rows, _end_rows)


THINKER_TO_TALKER = InputProcessor(thinker_to_talker, talker_wants, stream_embeds=thinker_rows)
TALKER_TO_CODE2WAV = InputProcessor(talker_to_code2wav, stream=TalkerFrames)
