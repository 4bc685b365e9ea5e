"""The talker's code predictor: after the talker samples a step's first code, a small dense
Qwen3 decoder predicts the step's other ``num_code_groups - 1`` codes (the residual
codebooks), as transformers' ``Qwen3OmniMoeTalkerForConditionalGeneration.
prepare_inputs_for_generation`` runs ``code_predictor.generate`` once per talker step.

Per step its input is two rows — the talker's last hidden state (after its final norm) and
the talker's embedding of the first code — then code ``i``'s embedding (its own table
``codec_embedding[i - 1]``); its head ``lm_head[i - 1]`` gives code ``i``. A fresh cache per
step: the whole predictor runs on ``[batch, <= num_code_groups, hidden]`` with plain causal
attention. The step's input embedding for the talker's next step is the sum of the talker's
embedding of the first code and the predictor's embeddings of the others.

Greedy requests take the argmax; sampled ones draw with transformers' fixed top-k 50, top-p
0.8 (temperature 1) from the request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.ar_config import ARModelConfig, RopeConfig
from omnistage.models.decoder import DecoderLayer, RMSNorm, RotaryEmbedding, apply_rotary
from omnistage.models.sampling import filter_scores

TOP_K = 50
TOP_P = 0.8


def predictor_config(raw: dict[str, Any]) -> ARModelConfig:
    """The predictor's decoder config from ``talker_config.code_predictor_config``."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    heads = int(raw["num_attention_heads"])
    return ARModelConfig(
        model_type=str(raw.get("model_type")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig(theta=theta),
        qk_norm=True,
        family="qwen3_omni",
        part="code_predictor",
    )


class _Model(nn.Module):
    def __init__(self, config: ARModelConfig, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [DecoderLayer(config, dtype, index=i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.codec_embedding = nn.ModuleList(
            [
                nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
                for _ in range(groups - 1)
            ]
        )


class CodePredictor(nn.Module):
    """Checkpoint names ``talker.code_predictor.{model.layers, model.norm,
    model.codec_embedding.i, lm_head.i}``, as transformers' module has them."""

    def __init__(self, config: ARModelConfig, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups = groups
        self.model = _Model(config, groups, dtype)
        self.lm_head = nn.ModuleList(
            [
                nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
                for _ in range(groups - 1)
            ]
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)  # derived, on the CPU

    def _forward(
        self, x: torch.Tensor, start: int, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """``x`` ``[B, L, hidden]`` at positions ``start ..``; k/v appended to ``cache``."""
        batch, length, _ = x.shape
        rotary = self.rotary.to(x.device)
        positions = torch.arange(start, start + length, device=x.device)
        cos, sin = rotary(positions, x.dtype)
        cos, sin = cos.repeat(batch, 1), sin.repeat(batch, 1)
        layers = cast(list[DecoderLayer], list(self.model.layers))
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            assert attn.q_norm is not None and attn.k_norm is not None
            h = layer.input_layernorm(x).reshape(batch * length, -1)
            q = attn.q_proj(h).view(batch * length, attn.num_heads, attn.head_dim)
            k = attn.k_proj(h).view(batch * length, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(h).view(batch, length, attn.num_kv_heads, attn.head_dim)
            q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k = k.view(batch, length, attn.num_kv_heads, attn.head_dim)
            if len(cache) > i:
                k = torch.cat([cache[i][0], k], dim=1)
                v = torch.cat([cache[i][1], v], dim=1)
                cache[i] = (k, v)
            else:
                cache.append((k, v))
            out = F.scaled_dot_product_attention(
                q.view(batch, length, -1, attn.head_dim).transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=length > 1,
                scale=attn.scale,
                enable_gqa=True,
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def predict(
        self,
        last_hidden: torch.Tensor,
        first_embeds: torch.Tensor,
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Codes ``[B, groups - 1]`` and their embeddings (one ``[B, hidden]`` per code)."""
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = torch.stack([last_hidden, first_embeds], dim=1)
        hidden = self._forward(self.project(x), 0, cache)[:, -1]
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for step in range(self.groups - 1):
            logits = cast(nn.Linear, self.lm_head[step])(hidden)
            code = self.choose(logits, greedy, generators)
            codes.append(code)
            embeds.append(cast(nn.Embedding, self.model.codec_embedding[step])(code))
            if step + 1 < self.groups - 1:
                hidden = self._forward(self.project(embeds[-1][:, None]), step + 2, cache)[:, -1]
        return torch.stack(codes, dim=1), embeds

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The predictor's inputs in its own width (here they are already)."""
        return x

    def choose(
        self, logits: torch.Tensor, greedy: Sequence[bool], generators: Sequence[torch.Generator]
    ) -> torch.Tensor:
        """Each row's code (transformers' fixed top-k / top-p for a sampled one)."""
        return choose_codes(logits, greedy, generators)


def choose_codes(
    logits: torch.Tensor,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator],
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Each row's code: the argmax, or a top-k / top-p draw (at ``temperature``) from its
    generator."""
    chosen = logits.argmax(dim=-1)
    for row, is_greedy in enumerate(greedy):
        if is_greedy:
            continue
        # Over the whole row, as the sampler draws a token: the generator moves as it does
        # under transformers' ``generate``, so a seeded draw is the reference's draw.
        filtered = filter_scores(logits[row], temperature, top_k, top_p)
        probs = torch.softmax(filtered, dim=-1).float()
        chosen[row] = torch.multinomial(probs, 1, generator=generators[row]).to(chosen.device)[0]
    return chosen
