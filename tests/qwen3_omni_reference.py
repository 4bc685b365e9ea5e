"""transformers' own Qwen3-Omni generation, with the intermediates a re-implementation must match.

``reference_generate(folder, prompt, voice=..., ...)`` loads the folder with
``Qwen3OmniMoeForConditionalGeneration.from_pretrained`` (float32) and calls

    model.generate(input_ids, speaker=voice, thinker_do_sample=False, talker_do_sample=False,
                   thinker_eos_token_id=im_end, thinker_max_new_tokens=...,
                   talker_max_new_tokens=..., talker_repetition_penalty=1.05)

and returns a ``Reference``: the thinker's new ids, the talker's codes [num_code_groups, frames]
and the waveform, plus what the pieces saw, captured by wrapping ``thinker.generate``,
``talker.generate``, ``talker.code_predictor.generate`` and ``code2wav.chunked_decode`` and by
forward hooks. Models and tokenizers are cached per folder.

Data flow, as verified against transformers 5.24.0 (``M`` = ``transformers/models/
qwen3_omni_moe/modeling_qwen3_omni_moe.py``, ``U`` = ``transformers/generation/utils.py``, ``C``
= ``transformers/utils/output_capturing.py``; tests/unit/models/qwen3_omni/test_tiny.py checks
each point position by position). ``L`` prompt ids, ``T`` generated thinker ids:

Thinker (M l. 4064-4160)
    Plain greedy generation with ``output_hidden_states=True``; MoE layers route by softmax
    over the experts, top-k, renormalised (``norm_topk_prob``, M l. 1345-1379); q/k RMSNorm
    per head before RoPE; head_dim from the config, not hidden / heads. ``generate``'s own default
    ``thinker_eos_token_id=151645`` is the real vocabulary's ``<|im_end|>``: pass the config's
    ``im_end_token_id`` (done here); ``thinker_ids`` ends with it when emitted. Positions: the
    prompt's come from ``get_rope_index`` (M l. 220-466) with the mask generate builds (U l.
    2878-2890): a text or audio-only prompt gets 0, 1, 2, ... in all three rows (no grids: the
    else branch), an image gets (t, h, w) rows per merged patch after its ``<|vision_start|>``
    (t = frame x position_id_per_seconds, 0 for an image) and the text after it continues at
    max + 1; decode steps add 1 to every row. Rows are interleaved over the rotary pairs
    (M l. 1291-1302: pair i is H for i % 3 == 1 below 3 x section[1], W for i % 3 == 2 below
    3 x section[2], else T), whatever the config's flags say. ``hidden_states[step][k]`` is
    the input of layer 0 (the embeddings, with encoder rows at media positions) for k = 0, the
    output of layer k-1 for 0 < k < layers -- captured by a hook on the layer, so BEFORE
    that layer's DeepStack rows are added (M l. 1708-1727, C l. 138-144) -- and the post-norm
    last hidden state for k = layers (C l. 367-378). Step 0 is the prompt, step s >= 1 the
    s-th decode step (input: generated id s-1); the last generated id is never fed back, so
    ``thinker_embeds`` / ``thinker_accept_hidden`` cover prompt + generated[:-1] (L + T - 1).

Talker inputs (M l. 4160-4281, ``_get_talker_user_parts`` l. 3983, ``_get_talker_assistant_parts``
l. 4005). ``P = text_projection``, ``Q = hidden_projection`` (ResizeMLPs thinker -> talker
width), ``e`` = thinker embedding rows, ``h`` = ``hidden_states[accept_hidden_layer]`` rows
(pre-norm: accept < layers); ``U`` = the user turn's length:
    - user part: every position whose last ``<|im_start|>`` is followed by ``user_token_id``
      (system turns and earlier assistant turns are dropped), in order: Q(h) at audio / image /
      video placeholder positions, P(e) elsewhere; ``talker_input_ids`` starts with their ids;
    - assistant part, from the LAST ``<|im_start|>assistant`` (9 rows): P(e) of
      ``<|im_start|>``, ``assistant``, ``\\n``; then tts_pad x 4, tts_bos, P(e(generated 0)),
      where tts_x = P(embed(tts_x_token_id)); codec rows added: 0, 0, 0, then
      codec_embed(nothink, think_bos, think_eos, speaker_id[voice], codec_pad, codec_bos);
      ``talker_input_ids`` ends with tts_pad_token_id x 9. T >= 2 generated ids are needed
      (with T = 1 the text side has 8 rows against 9 codec rows and the sum raises);
    - ``trailing_text_hidden`` [T - 1, D] = P(e(generated 1 .. T-2)), then tts_eos; the
      per-row eos rewrite (M l. 4238-4262) changes nothing for one sequence. So the last
      generated id is never spoken (it is the eos when the thinker stopped on it);
    - ``tts_pad_embed`` [D] = P(embed(tts_pad_token_id)).
    Prefill = ``talker_inputs_embeds`` [U + 9, D] as is (the codec rows are already in; no
    mask-dependent additions, unlike 2.5, so 5.x's dropped all-ones mask, U l. 2892-2907,
    changes nothing). Positions: ``_prepare_position_ids_for_generation`` (M l. 3304-3351)
    on ``talker_input_ids`` with the prompt's grids / audio lengths: text and audio-only
    prompts 0 .. U+8 in all rows, an image prompt ``get_rope_index`` over the talker's own
    ids (user part + 9 pads: positions restart at the user turn); decode steps +1 on every row.
Talker step (M l. 3370-3430, forward l. 3124-3221)
    The decoder: the thinker's attention (qk-norm, interleaved mRoPE), MoE layers plus a
    shared expert scaled by sigmoid(``shared_expert_gate``(x)) (M l. 2882-2903). Logits =
    ``codec_head`` (no bias) over its post-norm last hidden state. Greedy: repetition penalty
    1.05 over the first-codebook ids generated so far only (generate gets embeddings,
    no ids: U l. 1472-1487), codec ids [vocab - 1024, vocab) except codec_eos suppressed
    (M l. 4103), argmax. Decode step k >= 1 (input: code0 of frame k-1): the code predictor
    generates the frame's residual codes 1..G-1, greedily (``_prepare_generation_config``
    mirrors do_sample onto it, M l. 3366), from ``inputs_embeds`` = [talker hidden, codec_embed
    (code0)] where the talker hidden is ``hidden_states[0][-1][:, -1]`` of the previous
    forward = the POST-norm last hidden state (C l. 367-378), the row ``codec_head`` read;
    then the talker's input = codec_embed(code0) + sum_i predictor.codec_embedding[i-1](code_i)
    + (``trailing_text_hidden[k-1]`` while k-1 < len, else ``tts_pad_embed``).
Code predictor (M l. 2613-2790)
    Dense decoder (qk-norm, 1-D RoPE from 0: positions 0, 1 for the two prefill rows, then
    2, 3, ...). Step 0 (prefill): ``lm_head[0]`` -> code 1; step j >= 1: input
    ``codec_embedding[j-1](code j)``, ``lm_head[j]`` -> code j+1; G-1 steps, plain argmax (no
    penalty, no suppression).
Stopping (M l. 4273-4291)
    codec_eos or ``talker_max_new_tokens``. The frame of a sampled code0 is completed by the
    NEXT step, so the last sampled id never gets residual codes: with eos, frames = the
    codes before it; at max_new_tokens, frames = max_new_tokens - 1 and the last code0
    (``talker_sequence[-1]``) is dropped.
Code2wav (M l. 3895-3957)
    ``chunked_decode(codes [1, G, frames], 300, 25)``: one chunk for <= 300 frames; the mean of
    the G codebook embeddings (offset q x codebook_size), a sliding-window causal transformer,
    causal transposed convolutions (each decoder block trims one frame's worth), clamp [-1, 1].

Looks wrong in 5.24 and restored here (``restore_talker_audio_n_window``): the talker's
``get_rope_index`` reads ``self.config.audio_config.n_window`` for an audio placeholder when
the prompt also has image or video grids, but the talker config has no ``audio_config``, so an
audio + image prompt raises AttributeError; the original Qwen code used the default window
(50, the thinker's ``audio_config.n_window``), which the reference gives the talker config for
the call.

Video (``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid`` from the
processor, and ``use_audio_in_video``) reaches the thinker as it reaches it from transformers'
own processor. The talker gets the grids and ``video_second_per_grid`` but not
``use_audio_in_video`` (M l. 4133-4146), so for a video with its audio track it positions its
prompt as if the run were one audio followed by text: 0, 1, 2, ... omnistage gives the talker
the thinker's interleaved positions instead, which is what transformers computes when told
to (``talker_use_audio_in_video=True`` among ``processor_outputs``: generate hands
``talker_*`` keys to the talker; tests/integration/test_qwen3_omni.py compares so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.bench.omni_media import patched, quiet
from tests.omni_reference import detach, load_float32, prompt_ids


@dataclass
class Reference:
    """One ``generate`` call's outputs and intermediates (batch dimension dropped)."""

    prompt_ids: list[int]
    thinker_ids: list[int]  # generated, without the prompt; ends with <|im_end|> if emitted
    talker_codes: torch.Tensor  # [num_code_groups, frames]; row 0 the talker's own ids
    talker_sequence: list[int]  # every id the talker sampled (frames + the last, unfinished)
    waveform: np.ndarray  # float32 [samples]
    # thinker, per position of prompt + generated[:-1]: [L + T - 1, H]
    thinker_embeds: torch.Tensor  # hidden_states[0]
    thinker_accept_hidden: torch.Tensor  # hidden_states[accept_hidden_layer]
    thinker_last_hidden: torch.Tensor  # post-norm
    thinker_position_ids: list[torch.Tensor]  # [3, n] per thinker forward
    # talker inputs as talker.generate received them
    talker_inputs_embeds: torch.Tensor  # [U + 9, D]
    talker_input_ids: list[int]  # user ids + tts_pad_token_id x 9
    trailing_text_hidden: torch.Tensor  # [T - 1, D]
    tts_pad_embed: torch.Tensor  # [D]
    talker_generate_kwargs: dict[str, Any]
    # talker forwards (prefill, then one per decode step)
    talker_step_embeds: list[torch.Tensor] = field(default_factory=list)  # decode inputs, [D]
    talker_position_ids: list[torch.Tensor] = field(default_factory=list)  # [3, n] rope rows
    talker_hidden: list[torch.Tensor] = field(default_factory=list)  # post-norm last row, [D]
    talker_logits: list[torch.Tensor] = field(default_factory=list)  # raw codec_head, [V]
    # code predictor, one entry per decode step (= per frame)
    predictor_inputs: list[torch.Tensor] = field(default_factory=list)  # [2, D] prefill input
    predictor_step_embeds: list[torch.Tensor] = field(default_factory=list)  # [G - 2, D]
    predictor_logits: list[torch.Tensor] = field(default_factory=list)  # [G - 1, codebook]
    predictor_codes: list[list[int]] = field(default_factory=list)  # codes 1 .. G-1
    code2wav_codes: torch.Tensor | None = None  # [1, G, frames] as chunked_decode got them


def load_model(folder: str) -> Any:
    """``Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder)`` in float32, eval mode."""
    return load_float32("Qwen3OmniMoeForConditionalGeneration", folder)


@contextlib.contextmanager
def _talker_audio_n_window(model: Any, restore: bool) -> Iterator[None]:
    """The talker config gets the thinker's ``audio_config`` for the call (see the docstring)."""
    config = model.talker.config
    if not restore or hasattr(config, "audio_config"):
        yield
        return
    config.audio_config = model.config.thinker_config.audio_config
    try:
        yield
    finally:
        del config.audio_config


def reference_generate(
    folder: str | Path,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    voice: str,
    thinker_max_new_tokens: int,
    talker_max_new_tokens: int,
    processor_outputs: dict[str, Any] | None = None,
    talker_repetition_penalty: float = 1.05,
    restore_talker_audio_n_window: bool = True,
) -> Reference:
    """Run transformers' ``generate`` on ``prompt`` and capture its intermediates.

    ``processor_outputs``: what ``Qwen3OmniMoeProcessor`` made for a prompt with audio or
    images (``input_ids`` -- used instead of ``prompt`` --, ``attention_mask``,
    ``input_features``, ``feature_attention_mask``, ``pixel_values``, ``image_grid_thw``),
    passed to ``generate`` as the model card passes the processor's output (see
    tests/qwen3_omni_media.py). ``restore_talker_audio_n_window``: see the module docstring.
    """
    folder = str(Path(folder).resolve())
    model = load_model(folder)
    extra = dict(processor_outputs or {})
    given = extra.pop("input_ids", None)
    ids = given[0].tolist() if given is not None else prompt_ids(folder, prompt)
    extra.pop("num_audio_tokens", None)
    input_ids = torch.tensor([ids], dtype=torch.long)

    cap: dict[str, Any] = {k: [] for k in ("tpos", "tin", "thid", "tlog", "pin", "plog", "pcodes")}
    thinker_generate = model.thinker.generate
    talker_generate = model.talker.generate
    predictor_generate = model.talker.code_predictor.generate
    chunked_decode = model.code2wav.chunked_decode

    def thinker_wrapper(*args: Any, **kwargs: Any) -> Any:
        cap["thinker"] = thinker_generate(*args, **kwargs)
        return cap["thinker"]

    def talker_wrapper(*args: Any, **kwargs: Any) -> Any:
        cap["talker_kwargs"] = {k: detach(v) for k, v in kwargs.items()}
        cap["talker"] = talker_generate(*args, **kwargs)
        return cap["talker"]

    def predictor_wrapper(*args: Any, **kwargs: Any) -> Any:
        cap["pin"].append(kwargs["inputs_embeds"][0].detach().clone())
        cap["plog"].append([])
        result = predictor_generate(*args, **kwargs)
        cap["pcodes"].append(result.sequences[0].tolist())
        cap.setdefault("pembeds", []).append(
            torch.cat([h[0][0] for h in result.hidden_states[1:]]).detach().clone()
            if len(result.hidden_states) > 1
            else torch.zeros(0, kwargs["inputs_embeds"].shape[-1])
        )
        return result

    def decode_wrapper(codes: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cap["code2wav_codes"] = codes.detach().clone()
        return chunked_decode(codes, *args, **kwargs)

    def thinker_positions(_m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None:
            cap["thpos"] = cap.get("thpos", []) + [positions[-3:, 0].detach().clone()]

    def talker_inputs(_m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        cap["tpos"].append(kwargs["position_ids"][-3:, 0].detach().clone())
        cap["tin"].append(kwargs["inputs_embeds"][0].detach().clone())

    predictor = model.talker.code_predictor
    hooks = [
        model.thinker.model.language_model.register_forward_pre_hook(
            thinker_positions, with_kwargs=True
        ),
        model.talker.model.register_forward_pre_hook(talker_inputs, with_kwargs=True),
        model.talker.model.norm.register_forward_hook(
            lambda _m, _i, out: cap["thid"].append(out.detach()[0, -1].clone())
        ),
        model.talker.codec_head.register_forward_hook(
            lambda _m, _i, out: cap["tlog"].append(out.detach()[0, -1].clone())
        ),
        *(
            head.register_forward_hook(
                lambda _m, _i, out: cap["plog"][-1].append(out.detach()[0, -1].clone())
            )
            for head in predictor.lm_head
        ),
    ]
    try:
        with (
            patched(model.thinker, "generate", thinker_wrapper),
            patched(model.talker, "generate", talker_wrapper),
            patched(predictor, "generate", predictor_wrapper),
            patched(model.code2wav, "chunked_decode", decode_wrapper),
            _talker_audio_n_window(model, restore_talker_audio_n_window),
            quiet(),
            torch.no_grad(),
        ):
            sequences, waveform = model.generate(
                input_ids,
                speaker=voice,
                thinker_do_sample=False,
                talker_do_sample=False,
                thinker_eos_token_id=model.config.im_end_token_id,
                thinker_max_new_tokens=thinker_max_new_tokens,
                talker_max_new_tokens=talker_max_new_tokens,
                talker_repetition_penalty=talker_repetition_penalty,
                **extra,
            )
    finally:
        for hook in hooks:
            hook.remove()

    steps = cap["thinker"].hidden_states
    accept = model.config.talker_config.accept_hidden_layer
    kwargs = cap["talker_kwargs"]
    talker_sequence = cap["talker"].sequences[0].tolist()
    frames = len(cap["pcodes"])
    codes = torch.tensor([[talker_sequence[f]] + cap["pcodes"][f] for f in range(frames)])
    return Reference(
        prompt_ids=ids,
        thinker_ids=sequences[0, len(ids) :].tolist(),
        talker_codes=codes.T.reshape(model.config.talker_config.num_code_groups, frames),
        talker_sequence=talker_sequence,
        waveform=waveform.detach().float().reshape(-1).numpy().astype(np.float32),
        thinker_embeds=torch.cat([s[0][0] for s in steps]),
        thinker_accept_hidden=torch.cat([s[accept][0] for s in steps]),
        thinker_last_hidden=torch.cat([s[-1][0] for s in steps]),
        thinker_position_ids=cap.get("thpos", []),
        talker_inputs_embeds=kwargs.pop("inputs_embeds")[0],
        talker_input_ids=kwargs.pop("talker_input_ids")[0].tolist(),
        trailing_text_hidden=kwargs.pop("trailing_text_hidden")[0],
        tts_pad_embed=kwargs.pop("tts_pad_embed")[0, 0],
        talker_generate_kwargs=kwargs,
        talker_step_embeds=[row[-1] for row in cap["tin"][1:]],
        talker_position_ids=cap["tpos"],
        talker_hidden=cap["thid"],
        talker_logits=cap["tlog"],
        predictor_inputs=cap["pin"],
        predictor_step_embeds=cap.get("pembeds", []),
        predictor_logits=[torch.stack(step) for step in cap["plog"]],
        predictor_codes=cap["pcodes"],
        code2wav_codes=cap.get("code2wav_codes"),
    )
