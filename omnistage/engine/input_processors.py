"""Input processors: turn stage k's finished output into stage k+1's prompt.

The pipeline config names one per stage (``input_processor``). Each says what it needs from
the upstream stage (``wants``: hidden states, embeddings of some token ids), so the upstream
request asks for it, and converts the upstream ``StageResult`` into the prompt fields of the
next stage's request (its kind's preparer then adds the user's parameters and validates it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError, StageInternalError
from omnistage.stage.prepare import RequestOptions, Wants


@dataclass
class StageResult:
    """A stage's finished output for one request, as the next stage's processor sees it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None
    token_embeddings: torch.Tensor | None = None  # of the ``embed_token_ids`` it was asked for
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor knows besides the upstream result: the stage it feeds and the
    request's options."""

    stage: StageConfig
    options: RequestOptions


@dataclass(frozen=True)
class InputProcessor:
    convert: Callable[[StageResult, ProcessorContext], dict[str, Any]]
    wants: Callable[[ProcessorContext], Wants] = lambda ctx: Wants()


def _hidden(upstream: StageResult) -> torch.Tensor:
    if upstream.hidden_states is None:
        raise StageInternalError("the upstream AR stage returned no hidden_states")
    return upstream.hidden_states


def thinker_hidden_to_image_cond(upstream: StageResult, ctx: ProcessorContext) -> dict[str, Any]:
    """Condition an image decoder on the thinker's final hidden states (one row per token)."""
    return {"prompt_embeds": _hidden(upstream)}


def text_to_image_prompt(upstream: StageResult, ctx: ProcessorContext) -> dict[str, Any]:
    """Use the thinker's generated text as the image prompt of a text-conditioned decoder."""
    return {"prompt": upstream.text}


# -- Qwen2.5-Omni: thinker → talker → code2wav ---------------------------------------------


@functools.lru_cache(maxsize=8)
def _omni_checkpoint(folder: str) -> tuple[Any, dict[str, int]]:
    """The talker's special ids and each voice's text bos id, read once per checkpoint."""
    from omnistage.models import qwen_omni

    raw = qwen_omni.read_config(folder)
    if raw is None:
        raise StageInternalError(f"{folder} is not a Qwen2.5-Omni checkpoint")
    return qwen_omni.TalkerTokens.from_config(raw), qwen_omni.voice_bos_tokens(folder)


def _voice(ctx: ProcessorContext, voices: dict[str, int]) -> str:
    from omnistage.models.qwen_omni import default_voice

    voice = ctx.options.audio_params.get("voice") or default_voice(list(voices))
    if voice not in voices:
        raise InvalidRequestError(
            "audio_params.voice", f"unknown voice {voice!r}; this model has {sorted(voices)}"
        )
    return str(voice)


def _talker_wants(ctx: ProcessorContext) -> Wants:
    tokens, voices = _omni_checkpoint(ctx.stage.model)
    bos = voices[_voice(ctx, voices)]
    return Wants(
        hidden_states=True,
        hidden_states_with_embeddings=True,
        embed_token_ids=(bos, tokens.text_eos, tokens.text_pad),
    )


def thinker_to_talker(upstream: StageResult, ctx: ProcessorContext) -> dict[str, Any]:
    """The talker's prompt, built as transformers' ``Qwen2_5OmniForConditionalGeneration.
    generate`` builds it: per prompt position the thinker's input embedding plus its last
    hidden state; then the voice's text-bos embedding and the first reply token's; codec ids
    ``mask * L + [pad, bos]`` (the last two add their own codec embeddings in the talker).
    Each decode step then adds the next reply token's (embedding + hidden state), then the
    text-eos embedding, then text-pad for as long as the talker speaks."""
    tokens, _ = _omni_checkpoint(ctx.stage.model)
    sums = _hidden(upstream)
    if upstream.token_embeddings is None or len(upstream.token_embeddings) != 3:
        raise StageInternalError("the thinker returned no voice/eos/pad token embeddings")
    bos, eos, pad = upstream.token_embeddings.to(sums.dtype)
    prompt_len = upstream.num_prompt_tokens
    reply = sums[prompt_len:]  # the generated tokens fed back: all but the last
    if len(reply) == 0:  # one token only: the reply is its end
        reply = eos[None]
    prompt_embeds = torch.cat([sums[:prompt_len], bos[None], reply[:1]])
    decode_embeds = torch.cat([reply[1:], eos[None], pad[None]])
    ids = [tokens.codec_mask] * prompt_len + [tokens.codec_pad, tokens.codec_bos]
    return {
        "prompt_token_ids": ids,
        "prompt_embeds": prompt_embeds,
        "token_embeds_from": prompt_len,
        "decode_embeds": decode_embeds,
    }


def talker_to_code2wav(upstream: StageResult, ctx: ProcessorContext) -> dict[str, Any]:
    """The talker's codes up to (without) its first end code (codec end or pad)."""
    tokens, _ = _omni_checkpoint(ctx.stage.model)
    ends = {tokens.codec_eos, tokens.codec_pad}
    codes = list(upstream.token_ids)
    cut = next((i for i, c in enumerate(codes) if c in ends), len(codes))
    if cut == 0:
        raise InvalidRequestError("talker_params", "the talker produced no speech codes")
    return {"codes": codes[:cut]}


INPUT_PROCESSORS: dict[str, InputProcessor] = {
    "thinker_hidden_to_image_cond": InputProcessor(
        thinker_hidden_to_image_cond, lambda ctx: Wants(hidden_states=True)
    ),
    "text_to_image_prompt": InputProcessor(text_to_image_prompt),
    "thinker_to_talker": InputProcessor(thinker_to_talker, _talker_wants),
    "talker_to_code2wav": InputProcessor(talker_to_code2wav),
}


def get_input_processor(name: str) -> InputProcessor:
    try:
        return INPUT_PROCESSORS[name]
    except KeyError:
        raise ValueError(
            f"unknown input_processor {name!r}; known: {sorted(INPUT_PROCESSORS)}"
        ) from None
