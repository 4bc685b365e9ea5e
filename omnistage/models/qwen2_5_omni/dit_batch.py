"""The DiT's classifier-free-guided velocity for several utterances in one forward.

``Qwen2_5OmniToken2WavDiTModel.forward`` runs the speaker encoder (ECAPA, convolutions) on
the reference mel inside every call, and oneDNN's convolutions round differently per batch
size; everything else in the DiT is row-wise (linear layers, made row-invariant by MKL's
strict reproducibility mode and ``invariant_linear``'s padding, see
``omnistage.batch_invariance``; attention per row; norms and activations per frame). So
``DiTRows`` runs the speaker encoder once per utterance, on the same two rows ``forward``
gives it (the reference and zeros), and with it makes the other inputs that do not change
between calls (the code embeddings, the speaker rows), and ``guided_velocity`` runs the rest
of ``forward`` term by term on the rows of several utterances — each its own codes, state
and time point — giving each utterance the velocity it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DiTRows:
    """One utterance's (or window's) constant inputs of the guided DiT call, made once for
    all its calls: ``conditions`` are the rows (guided, null) of what ``DiTInputEmbedding``
    puts beside the state, ``cat((ref, code_embed, speaker), -1)``."""

    codes: torch.Tensor  # [1, codes]
    conditions: torch.Tensor  # [2, frames, enc_dim + emb_dim + enc_emb_dim]
    guidance_scale: float

    @classmethod
    @torch.inference_mode()
    def of(
        cls,
        dit: Any,
        codes: torch.Tensor,
        speaker: torch.Tensor,
        ref_mel: torch.Tensor,
        scale: float,
    ) -> DiTRows:
        refs = torch.cat([ref_mel, torch.zeros_like(ref_mel)], dim=0)
        ref = dit.input_embed.spk_encoder(refs).unsqueeze(1).repeat(1, speaker.shape[1], 1)
        code_embed = torch.cat(
            [dit.text_embed(codes, drop_code=False), dit.text_embed(codes, drop_code=True)]
        )
        speakers = torch.cat([speaker, torch.zeros_like(speaker)], dim=0)
        return cls(codes, torch.cat((ref, code_embed, speakers), dim=-1), float(scale))

    @property
    def frames(self) -> int:
        return int(self.conditions.shape[1])


def layer_masks(dit: Any, hidden: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """The layers' additive attention masks by ``(look_backward_block, look_ahead_block)``:
    ``_create_block_diff``'s block differences compared as ``DiTDecoderLayer`` compares them,
    made once per call as ``[1, 1, n, n]`` float (0 or -inf, what SDPA turns the layer's
    boolean ``[batch, heads, n, n]`` mask into in every layer)."""
    n = hidden.shape[1]
    blocks = torch.arange(n, device=hidden.device) // dit.block_size
    diff = blocks.unsqueeze(0) - blocks.unsqueeze(1)
    masks: dict[tuple[int, int], torch.Tensor] = {}
    for block in dit.transformer_blocks:
        key = (block.look_backward_block, block.look_ahead_block)
        if key not in masks:
            allowed = (diff >= -float(key[0])) & (diff <= float(key[1]))
            mask = torch.zeros([n, n], dtype=hidden.dtype, device=hidden.device)
            masks[key] = mask.masked_fill_(~allowed, float("-inf"))[None, None]
    return masks


def decoder_layer(
    block: Any,
    hidden: torch.Tensor,
    time_embedding: torch.Tensor,
    position_embeddings: Any,
    mask: torch.Tensor,
) -> torch.Tensor:
    """``DiTDecoderLayer.forward`` term by term, with the layer's mask made beforehand."""
    norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.attn_norm(hidden, emb=time_embedding)
    attention = block.attn(
        hidden_states=norm, position_embeddings=position_embeddings, attention_mask=mask
    )
    hidden = hidden + gate_msa.unsqueeze(1) * attention
    norm = block.ff_norm(hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    return hidden + gate_mlp.unsqueeze(1) * block.ff(norm)


@torch.inference_mode()
def guided_velocity(
    dit: Any, rows: list[DiTRows], times: list[torch.Tensor], states: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``guided + (guided - null) * scale`` per utterance, as ``sample()``'s ``ode_function``
    computes it with ``apply_cfg=True``, for utterances of the same number of frames."""
    n = len(rows)
    y = torch.cat(states, dim=0)
    hidden = torch.cat([y, y], dim=0)  # guided rows, then null rows
    time_step = torch.stack([t.reshape(()) for t in times])
    time_embedding = dit.time_embed(torch.cat([time_step, time_step], dim=0))
    conditions = [r.conditions[:1] for r in rows] + [r.conditions[1:] for r in rows]
    hidden = dit.input_embed.proj(torch.cat((hidden, torch.cat(conditions, dim=0)), dim=-1))
    # the rotary table of one row: every row's is the same, and it broadcasts over the batch
    position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None, :]
    position_embeddings = dit.rotary_embed(hidden, position_ids)
    masks = layer_masks(dit, hidden)
    for block in dit.transformer_blocks:
        mask = masks[block.look_backward_block, block.look_ahead_block]
        hidden = decoder_layer(block, hidden, time_embedding, position_embeddings, mask)
    hidden = dit.norm_out(hidden, time_embedding)
    output = dit.proj_out(hidden)
    return [
        output[i : i + 1] + (output[i : i + 1] - output[n + i : n + i + 1]) * rows[i].guidance_scale
        for i in range(n)
    ]
