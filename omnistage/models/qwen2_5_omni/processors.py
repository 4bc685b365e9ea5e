"""Qwen2.5-Omni's hand-offs: thinker → talker → code2wav, as transformers'
``Qwen2_5OmniForConditionalGeneration.generate`` chains them."""

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
from omnistage.models.qwen2_5_omni.config import CHECKPOINT, TalkerTokens
from omnistage.models.qwen2_5_omni.voices import default_voice, voice_bos_tokens

VOICE_FIELD = "audio_params"  # where a request names its voice (the code2wav stage's params)


@functools.lru_cache(maxsize=8)
def checkpoint_tokens(folder: str) -> tuple[TalkerTokens, dict[str, int]]:
    """The talker's special ids and each voice's text bos id, read once per checkpoint."""
    raw = CHECKPOINT.config(folder, StageInternalError)
    return TalkerTokens.from_config(raw), voice_bos_tokens(folder)


def chosen_voice(params: RequestParams, voices: dict[str, int]) -> str:
    voice = (params.get(VOICE_FIELD) or {}).get("voice") or default_voice(list(voices))
    if voice not in voices:
        raise InvalidRequestError(
            f"{VOICE_FIELD}.voice", f"unknown voice {voice!r}; this model has {sorted(voices)}"
        )
    return str(voice)


def talker_wants(folder: str, params: RequestParams) -> Wants:
    tokens, voices = checkpoint_tokens(folder)
    bos = voices[chosen_voice(params, voices)]
    return Wants(
        hidden_states=True,
        hidden_states_with_embeddings=True,
        embed_token_ids=(bos, tokens.text_eos, tokens.text_pad),
        text_embeddings_only=True,  # transformers zeroes the multimodal positions' embeddings
    )


def thinker_to_talker(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    """The talker's prompt, built as transformers' ``generate`` builds it: per prompt position
    the thinker's input embedding (zero at multimodal placeholders) plus its last hidden
    state, at the thinker's positions (its multimodal rotary ones, continued by two text
    positions, with the thinker's delta after); then the voice's text-bos
    embedding and the first reply token's; codec ids ``mask * L + [pad, bos]`` (the last two
    add their own codec embeddings in the talker). Each decode step then adds the next reply
    token's (embedding + hidden state), then the text-eos embedding, then text-pad for as long
    as the talker speaks."""
    tokens, _ = checkpoint_tokens(folder)
    sums = hidden_states_of(upstream)
    if upstream.token_embeddings is None or len(upstream.token_embeddings) != 3:
        raise StageInternalError("the thinker handed over no voice/eos/pad token embeddings")
    bos, eos, pad = upstream.token_embeddings.to(sums.dtype)
    prompt_len = upstream.num_prompt_tokens
    reply = sums[prompt_len:]  # the generated tokens fed back: all but the last
    if len(reply) == 0:  # one token only: the reply is its end
        reply = eos[None]
    prompt_embeds = torch.cat([sums[:prompt_len], bos[None], reply[:1]])
    decode_embeds = torch.cat([reply[1:], eos[None], pad[None]])
    ids = [tokens.codec_mask] * prompt_len + [tokens.codec_pad, tokens.codec_bos]
    fields: dict[str, Any] = {
        "prompt_token_ids": ids,
        "prompt_embeds": prompt_embeds,
        "token_embeds_from": prompt_len,
        "decode_embeds": decode_embeds,
    }
    if upstream.positions is not None:  # the thinker's prompt positions, then two text ones
        after = int(upstream.positions.max()) + 1
        tail = torch.arange(after, after + 2, dtype=torch.long).expand(3, -1)
        fields["positions"] = torch.cat([upstream.positions, tail], dim=1)
        fields["position_delta"] = upstream.position_delta
    return fields


def talker_to_code2wav(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    """The talker's codes up to (without) its first end code (codec end or pad)."""
    tokens, _ = checkpoint_tokens(folder)
    ends = {tokens.codec_eos, tokens.codec_pad}
    codes = list(upstream.token_ids)
    cut = next((i for i, c in enumerate(codes) if c in ends), len(codes))
    if cut == 0:
        raise InvalidRequestError("talker_params", "the talker produced no speech codes")
    return {"codes": codes[:cut]}


class TalkerCodes:
    """The talker's codes as they come, up to (without) its first end code: the streamed
    form of ``talker_to_code2wav``."""

    def __init__(self, folder: str) -> None:
        tokens, _ = checkpoint_tokens(folder)
        self.ends = {tokens.codec_eos, tokens.codec_pad}
        self.num_codes = 0
        self.ended = False

    def feed(self, token_ids: list[int], final: bool) -> tuple[list[int], bool]:
        if self.ended:
            return [], True
        cut = next((i for i, c in enumerate(token_ids) if c in self.ends), None)
        codes = list(token_ids if cut is None else token_ids[:cut])
        self.num_codes += len(codes)
        self.ended = final or cut is not None
        if self.ended and self.num_codes == 0:
            raise InvalidRequestError("talker_params", "the talker produced no speech codes")
        return codes, self.ended


def _end_rows(first: UpstreamResult) -> torch.Tensor:
    """After the reply: the text-eos embedding, then text-pad (repeating)."""
    if first.token_embeddings is None or len(first.token_embeddings) != 3:
        raise StageInternalError("the thinker handed over no voice/eos/pad token embeddings")
    return first.token_embeddings[1:]


def thinker_rows(folder: str, params: RequestParams) -> RowsStream:
    """The streamed form of ``thinker_to_talker``: each reply token's (embedding + hidden
    state) as the thinker makes it."""
    return RowsStream(folder, params, thinker_to_talker, lambda rows: rows, _end_rows)


THINKER_TO_TALKER = InputProcessor(thinker_to_talker, talker_wants, stream_embeds=thinker_rows)
TALKER_TO_CODE2WAV = InputProcessor(talker_to_code2wav, stream=TalkerCodes)
