"""transformers' own Qwen2.5-Omni generation, with the intermediates a re-implementation must match.

``reference_generate(folder, prompt, voice=..., seed=..., ...)`` loads the folder with
``Qwen2_5OmniForConditionalGeneration.from_pretrained`` (float32; it reads ``spk_dict.pt``
itself), calls ``torch.manual_seed(seed)`` and then

    model.generate(input_ids, speaker=voice, thinker_do_sample=False, talker_do_sample=False,
                   talker_eos_token_id=[codec_pad, codec_eos], thinker_max_new_tokens=...,
                   talker_max_new_tokens=..., token2wav_num_steps=...,
                   talker_repetition_penalty=1.05)

and returns a ``Reference``: the thinker's new ids, the talker's codes (before its eos) and the
waveform, plus what the pieces saw, captured by wrapping ``thinker.generate``,
``talker.generate``, ``talker.forward`` and ``token2wav.forward`` and by forward hooks. The
``talker.forward`` wrapper also restores the prefill's codec embeddings that transformers 5.x
loses (``codec_prefill_embeds``, below). Models and tokenizers are cached per folder.

Data flow, as verified against transformers 5.24.0 (``M`` = ``transformers/models/
qwen2_5_omni/modeling_qwen2_5_omni.py``, ``U`` = ``transformers/generation/utils.py``; the
tests in tests/unit/models/qwen2_5_omni/test_tiny.py check each point position by position):

Thinker (``Qwen2_5OmniForConditionalGeneration.generate``, M l. 3805-4070)
    Plain greedy generation of the text decoder with ``output_hidden_states=True`` (M l. 3905,
    3908). For a text-only prompt the mRoPE positions are 0, 1, 2, ... in all three rows
    (M l. 2122-2170 and ``get_rope_index``'s text branch M l. 496-503): ordinary RoPE over
    head_dim = hidden / heads. It stops at its generation config's eos (built from
    ``text_config.eos_token_id`` = ``<|im_end|>``) or at ``thinker_max_new_tokens``;
    ``thinker_ids`` includes that final eos when emitted. ``hidden_states[step][0]`` is the
    embedding output (``embed_tokens(ids)``) and ``hidden_states[step][-1]`` the last layer's
    output AFTER the final RMSNorm, per position (step 0 = the prompt, step k >= 1 = the k-th
    decode step, whose input is generated token k-1; the last generated token is never fed
    back) (M l. 3914-3953). G >= 2 generated tokens are needed (with G = 1 the reply part
    below is empty and transformers' talker prefill is malformed).

Talker inputs (M l. 3955-4039)
    With ``E = embedding output + post-norm last hidden`` per thinker position
    (``thinker_embeds + thinker_hidden`` here) and ``embed`` the thinker's ``embed_tokens``:
    - ``talker_inputs_embeds`` [L+2, H] = [E(prompt 0..L-1), embed(voice bos_token),
      E(generated token 0)] (M l. 3973-3988);
    - ``talker_input_ids`` = [codec_mask] * L + [codec_pad, codec_bos] (M l. 3964-3971) and
      ``talker_input_text_ids`` = prompt + [voice bos_token, generated token 0] (M l. 3955);
    - ``thinker_reply_part`` [G, H] = [E(generated 1..G-2), embed(tts_text_end_token_id),
      embed(tts_text_pad_token_id)] (M l. 3974, 3989-4002); the per-row rewrite of
      M l. 4004-4023 changes nothing for one sequence that ends at its first eos or at
      ``thinker_max_new_tokens``.
    - Prefill codec embeddings: the talker's forward adds ``codec_embed(codec_bos)`` to
      ``inputs_embeds[:, -1]`` and ``codec_embed(codec_pad)`` to ``inputs_embeds[:, -2]``, in
      place, but ONLY when it receives an attention mask (M l. 2390-2413). transformers 5.x's
      generate drops an all-ones mask before the first forward (U l. 2892-2907), so as
      shipped an unpadded request gets no codec embeddings, unlike the original Qwen code,
      transformers 4.x and a padded batch in 5.x. ``codec_prefill_embeds=True`` (the
      default) restores the intended behaviour by giving the talker's forward an all-ones
      mask; positions and attention stay as they are. The prompt positions never get a codec
      (mask) embedding. ``talker_prefill_embeds`` is the resulting input of
      ``thinker_to_talker_proj`` (Linear H -> talker hidden, with bias, M l. 2435).
    - Decode step k = 1, 2, ...: input = codec_embed(code k-1) + reply[0]; then the reply
      drops its first row unless only one is left, so the last (pad) row repeats forever
      (M l. 2429-2433). ``talker_step_embeds[k-1]`` is that sum.
    - Positions: 0 .. L+1 for the prefill, then L+2, L+3, ... (M l. 2390-2427 with a mask,
      ``Qwen2_5OmniTalkerModel.forward``'s arange without): ordinary RoPE, head_dim from the
      config (not hidden / heads), ``rope_parameters`` theta.
    - Logits: ``codec_head`` (no bias) over the talker's final RMSNorm output (M l. 2451).
      Greedy generation then applies the repetition penalty (1.05 by default, M l. 3817;
      U l. 1472-1480) over every id of the talker's input_ids (the codec mask/pad/bos prompt
      ids included) and the codes so far, each id once (positive logits / 1.05, negative
      * 1.05), and ``suppress_tokens=[codec_bos]`` (-inf, M l. 4037); no temperature /
      top-k / top-p when greedy. It stops at codec pad or codec eos (``eos_token_id`` as
      given; ``pad_token_id`` = codec pad) or after ``talker_max_new_tokens``;
      ``talker_codes`` stops before that eos (M l. 4040-4044).

Token2wav (M l. 4046-4063 and ``Qwen2_5OmniToken2WavModel`` M l. 3647-3715)
    Always float32 (``enable_talker`` calls ``token2wav.float()``, M l. 3740, and generate
    casts it back if needed, M l. 4047); the voice's ``cond`` [1, enc_emb_dim] and ``ref_mel``
    [1, T, mel_dim] are cast to float and expanded to the batch (M l. 4050-4051), one sample
    at a time. ``sample`` (M l. 3576-3644) draws ``noise = torch.randn([1, codes * repeats,
    mel_dim])`` from the GLOBAL generator (M l. 3594): with greedy thinker and talker nothing
    else draws, so it is the first draw after ``torch.manual_seed(seed)``
    (``noise_is_first_draw_after_seed``). Times ``t = linspace(0, 1, num_steps)``, then
    ``t += -1 * (cos(pi/2 t) - 1 + t)`` (sway -1, M l. 3632); one RK4 "3/8 rule" step per
    interval (``(k1 + 3 (k2 + k3) + k4) dt / 8``, M l. 3415-3473), each function evaluation a
    DiT pass over a batch of 2 (CFG): row 0 conditioned, row 1 with zero ``cond``, zero
    ``ref_mel`` and every code replaced by 0, combined as ``c + (c - u) * 0.5``
    (M l. 3543, 3624). The DiT's RoPE (theta 10000) rotates only the FIRST attention head,
    de-interleaving its q/k first (M l. 2992); attention is block-local (blocks of
    ``block_size`` frames; one block back / ahead only in the configured layers). ``mel``
    [1, mel_dim, frames] goes to BigVGAN, whose output is clamped to [-1, 1] (M l. 3412):
    ``len(waveform) = codes * repeats * prod(upsample_rates)``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.bench.omni_media import patched, quiet
from tests.omni_reference import detach, load_float32, prompt_ids

DEFAULT_NUM_STEPS = 10  # token2wav's default ODE time points


@dataclass
class Reference:
    """One ``generate`` call's outputs and intermediates (batch dimension dropped)."""

    prompt_ids: list[int]
    thinker_ids: list[int]  # generated, without the prompt; ends with the eos if emitted
    talker_codes: list[int]  # before the first codec pad / eos
    talker_sequence: list[int]  # every generated talker id, the stopping one included
    waveform: np.ndarray  # float32 [len(talker_codes) * samples_per_code]
    # thinker, per position of prompt + generated[:-1]: [L + G - 1, H]
    thinker_embeds: torch.Tensor
    thinker_hidden: torch.Tensor
    # talker inputs as talker.generate received them
    talker_input_ids: list[int]
    talker_input_text_ids: list[int]
    talker_inputs_embeds: torch.Tensor  # [L + 2, H] before the codec embeddings are added
    thinker_reply_part: torch.Tensor  # [G, H]
    talker_prefill_embeds: torch.Tensor  # [L + 2, H] input of thinker_to_talker_proj
    talker_step_embeds: list[torch.Tensor] = field(default_factory=list)  # each [H]
    talker_position_ids: list[torch.Tensor] = field(default_factory=list)  # [3, n] per call
    talker_logits: list[torch.Tensor] = field(default_factory=list)  # raw codec_head, [V]
    talker_generate_kwargs: dict[str, Any] = field(default_factory=dict)
    # token2wav
    conditioning: torch.Tensor | None = None  # [1, enc_emb_dim]
    reference_mel: torch.Tensor | None = None  # [1, T, mel_dim]
    noise: torch.Tensor | None = None  # [1, frames, mel_dim], the DiT's initial state
    noise_is_first_draw_after_seed: bool = False
    mel: torch.Tensor | None = None  # [1, mel_dim, frames], BigVGAN's input
    token2wav_kwargs: dict[str, Any] = field(default_factory=dict)


def load_model(folder: str) -> Any:
    """``Qwen2_5OmniForConditionalGeneration.from_pretrained(folder)`` in float32, eval mode."""
    return load_float32("Qwen2_5OmniForConditionalGeneration", folder)


def _multimodal_kwargs(outputs: dict[str, Any] | None, input_ids: torch.Tensor) -> dict[str, Any]:
    if not outputs:
        return {}
    kwargs = {k: v for k, v in outputs.items() if k not in ("input_ids", "attention_mask")}
    kwargs["attention_mask"] = torch.ones_like(input_ids)
    # generate hands every unprefixed keyword to the talker's generate too, which refuses
    # pixels (a ValueError for any image or video prompt with speech out); its ``thinker_``
    # prefix gives them to the thinker alone, where they belong (the grids stay shared: the
    # talker's positions need them).
    for name in ("pixel_values", "pixel_values_videos"):
        if name in kwargs:
            kwargs["thinker_" + name] = kwargs.pop(name)
    return kwargs


def reference_generate(
    folder: str | Path,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    voice: str,
    seed: int,
    thinker_max_new_tokens: int,
    talker_max_new_tokens: int,
    num_steps: int = DEFAULT_NUM_STEPS,
    talker_repetition_penalty: float = 1.05,
    codec_prefill_embeds: bool = True,
    processor_outputs: dict[str, Any] | None = None,
) -> Reference:
    """Run transformers' ``generate`` on ``prompt`` and capture its intermediates.

    ``codec_prefill_embeds``: add the codec pad / bos embeddings to the talker prefill's last
    two positions, as the original Qwen2.5-Omni code and transformers 4.x do. transformers 5.x
    drops an all-ones attention mask before the forward (generation/utils.py, "We can drop
    the mask altogether if it's all 1s"), and the talker only adds them when it gets a mask;
    so True hands the talker's forward an explicit all-ones mask (nothing else changes:
    same positions, same causal attention), and False is transformers 5.x as it is.

    ``processor_outputs``: what ``Qwen2_5OmniProcessor`` made besides ``input_ids`` for a
    prompt with audio, images or video (``input_features``, ``feature_attention_mask``,
    ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
    ``video_second_per_grid``, ``use_audio_in_video``), passed to ``generate`` with an
    all-ones ``attention_mask``, as the model card's example passes the processor's output:
    without a mask transformers computes no multimodal positions.
    """
    folder = str(Path(folder).resolve())
    model = load_model(folder)
    talker_config = model.config.talker_config
    codec_pad, codec_eos = (
        talker_config.tts_codec_pad_token_id,
        talker_config.tts_codec_end_token_id,
    )
    ids = prompt_ids(folder, prompt)
    input_ids = torch.tensor([ids], dtype=torch.long)

    captured: dict[str, Any] = {"proj_inputs": [], "positions": [], "logits": []}
    thinker_generate = model.thinker.generate
    talker_generate = model.talker.generate
    token2wav_forward = model.token2wav.forward
    talker_forward = model.talker.forward

    def thinker_wrapper(*args: Any, **kwargs: Any) -> Any:
        result = thinker_generate(*args, **kwargs)
        captured["thinker"] = result
        return result

    def talker_wrapper(*args: Any, **kwargs: Any) -> Any:
        # inputs_embeds is modified in place by the first forward: keep a copy first.
        captured["talker_kwargs"] = {k: detach(v) for k, v in kwargs.items()}
        result = talker_generate(*args, **kwargs)
        captured["talker_result"] = result
        return result

    @functools.wraps(talker_forward)  # generate inspects the forward's signature
    def talker_forward_wrapper(*args: Any, **kwargs: Any) -> Any:
        if codec_prefill_embeds and kwargs.get("attention_mask") is None:
            cache = kwargs.get("cache")
            past = cache.get_seq_length() if cache is not None else 0
            embeds = kwargs.get("inputs_embeds")
            new = (embeds if embeds is not None else kwargs["input_ids"]).shape[:2]
            kwargs["attention_mask"] = torch.ones(new[0], past + new[1], dtype=torch.long)
        return talker_forward(*args, **kwargs)

    def position_hook(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is None:  # the talker model's default: arange after the cache
            cache, embeds = kwargs.get("cache"), kwargs["inputs_embeds"]
            past = cache.get_seq_length() if cache is not None else 0
            positions = torch.arange(past, past + embeds.shape[1]).expand(3, 1, -1)
        captured["positions"].append(positions[:, 0].detach().clone())

    def token2wav_wrapper(*args: Any, **kwargs: Any) -> Any:
        captured["rng_state"] = torch.get_rng_state()
        captured["token2wav_args"] = [detach(a) for a in args]
        captured["token2wav_kwargs"] = {k: detach(v) for k, v in kwargs.items()}
        return token2wav_forward(*args, **kwargs)

    hooks = [
        model.talker.thinker_to_talker_proj.register_forward_pre_hook(
            lambda _m, inputs: captured["proj_inputs"].append(inputs[0].detach().clone())
        ),
        model.talker.model.register_forward_pre_hook(position_hook, with_kwargs=True),
        model.talker.codec_head.register_forward_hook(
            lambda _m, _inputs, output: captured["logits"].append(output.detach()[0, -1].clone())
        ),
        model.token2wav.code2wav_bigvgan_model.register_forward_pre_hook(
            lambda _m, inputs: captured.__setitem__("mel", inputs[0].detach().clone())
        ),
    ]
    try:
        with (
            patched(model.thinker, "generate", thinker_wrapper),
            patched(model.talker, "generate", talker_wrapper),
            patched(model.talker, "forward", talker_forward_wrapper),
            patched(model.token2wav, "forward", token2wav_wrapper),
            quiet(),
            torch.no_grad(),
        ):
            torch.manual_seed(seed)
            sequences, waveform = model.generate(
                input_ids,
                speaker=voice,
                thinker_do_sample=False,
                talker_do_sample=False,
                talker_eos_token_id=[codec_pad, codec_eos],
                thinker_max_new_tokens=thinker_max_new_tokens,
                talker_max_new_tokens=talker_max_new_tokens,
                talker_repetition_penalty=talker_repetition_penalty,
                token2wav_num_steps=num_steps,
                **_multimodal_kwargs(processor_outputs, input_ids),
            )
    finally:
        for hook in hooks:
            hook.remove()

    thinker_result = captured["thinker"]
    steps = thinker_result.hidden_states
    thinker_embeds = torch.cat([step[0][0] for step in steps], dim=0)
    thinker_hidden = torch.cat([step[-1][0] for step in steps], dim=0)

    talker_kwargs = captured["talker_kwargs"]
    talker_input_ids = talker_kwargs.pop("input_ids")[0].tolist()
    talker_sequence = captured["talker_result"][0, len(talker_input_ids) :].tolist()
    stops = [i for i, code in enumerate(talker_sequence) if code in (codec_pad, codec_eos)]
    talker_codes = talker_sequence[: stops[0]] if stops else talker_sequence
    proj_inputs = captured["proj_inputs"]

    # The DiT's initial noise, redrawn from the global RNG state token2wav started from.
    t2w_args, t2w_kwargs = captured["token2wav_args"], dict(captured["token2wav_kwargs"])
    mel_dim = model.config.token2wav_config.dit_config.mel_dim
    repeats = model.config.token2wav_config.dit_config.repeats
    generator = torch.Generator().set_state(captured["rng_state"])
    noise = torch.randn([1, len(talker_codes) * repeats, mel_dim], generator=generator)
    torch.manual_seed(seed)
    first_draw = bool(torch.equal(torch.get_rng_state(), captured["rng_state"]))

    return Reference(
        prompt_ids=ids,
        thinker_ids=sequences[0, len(ids) :].tolist(),
        talker_codes=talker_codes,
        talker_sequence=talker_sequence,
        waveform=waveform.detach().float().numpy().astype(np.float32),
        thinker_embeds=thinker_embeds,
        thinker_hidden=thinker_hidden,
        talker_input_ids=talker_input_ids,
        talker_input_text_ids=talker_kwargs.pop("input_text_ids")[0].tolist(),
        talker_inputs_embeds=talker_kwargs.pop("inputs_embeds")[0],
        thinker_reply_part=talker_kwargs.pop("thinker_reply_part")[0],
        talker_prefill_embeds=proj_inputs[0][0],
        talker_step_embeds=[p[0, -1] for p in proj_inputs[1:]],
        talker_position_ids=captured["positions"],
        talker_logits=captured["logits"],
        talker_generate_kwargs=talker_kwargs,
        conditioning=t2w_kwargs.pop("conditioning"),
        reference_mel=t2w_kwargs.pop("reference_mel"),
        noise=noise,
        noise_is_first_draw_after_seed=first_draw,
        mel=captured.get("mel"),
        token2wav_kwargs={"code": t2w_args[0] if t2w_args else None, **t2w_kwargs},
    )
