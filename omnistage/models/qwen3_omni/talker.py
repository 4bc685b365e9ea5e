"""Qwen3-Omni's talker: a Qwen3-MoE decoder (every layer's experts with a gated shared
expert; interleaved multimodal RoPE) over codec ids, whose step emits a frame of
``num_code_groups`` codes — the first from its ``codec_head``, the others from its code
predictor (``code_predictor``) — and takes the frame's summed embeddings plus the next reply
token's projected thinker embedding as its next input.

Its requests bring the thinker's rows in the thinker's width plus a flag column
(``inputs_embeds_size = thinker hidden + 1``): ``project_embeds`` maps a row flagged 1 (a
multimodal position: the thinker's hidden state at ``accept_hidden_layer``) through
``hidden_projection`` and any other (a text embedding) through ``text_projection``, as
transformers' ``_get_talker_user_parts`` / ``_get_talker_assistant_parts`` do.

Checkpoint names: ``talker.model.codec_embedding`` is the token embedding, ``talker.model.*``
the decoder, ``talker.codec_head`` the head, ``talker.{text,hidden}_projection.linear_fc{1,2}``
and ``talker.code_predictor.*`` as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.decoder import CausalLM
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, predictor_config
from omnistage.models.qwen3_omni.weights import prefix_rename
from omnistage.models.tensor_parallel import SINGLE, TPGroup

PARAMS_FIELD = "talker_params"
# transformers' Qwen3OmniMoeForConditionalGeneration.generate talker defaults.
TALKER_DEFAULTS: dict[str, Any] = {
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "max_tokens": 4096,
}
SUPPRESSED_BLOCK = 1024  # generate never samples the top 1024 ids, but codec_eos
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' when the config gives none


@dataclass(frozen=True)
class TalkerTokens:
    """The talker's codec ids and voices (``talker_config``)."""

    pad: int
    bos: int
    eos: int
    nothink: int
    think_bos: int
    think_eos: int
    voices: dict[str, int]
    accept_hidden_layer: int
    groups: int

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> TalkerTokens:
        talker = raw.get("talker_config") or {}
        try:
            return cls(
                pad=int(talker["codec_pad_id"]),
                bos=int(talker["codec_bos_id"]),
                eos=int(talker["codec_eos_token_id"]),
                nothink=int(talker["codec_nothink_id"]),
                think_bos=int(talker["codec_think_bos_id"]),
                think_eos=int(talker["codec_think_eos_id"]),
                voices={str(k).lower(): int(v) for k, v in (talker["speaker_id"] or {}).items()},
                accept_hidden_layer=int(talker["accept_hidden_layer"]),
                groups=int(talker["num_code_groups"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json: talker_config lacks {exc}") from None


def talker_config(raw: dict[str, Any]) -> ARModelConfig:
    from omnistage.models.qwen3_moe import layout as moe_layout

    talker = raw.get("talker_config") or {}
    text = dict(talker.get("text_config") or {})
    if not text or not talker.get("code_predictor_config"):
        raise CheckpointError("config.json: talker_config lacks text_config/code_predictor_config")
    tokens = TalkerTokens.from_config(raw)
    layout = moe_layout(text)
    # every talker layer runs its experts (transformers builds them so, whatever the flags)
    layout.update(decoder_sparse_step=1, mlp_only_layers=())
    vocab = int(text["vocab_size"])
    suppressed = tuple(i for i in range(max(vocab - SUPPRESSED_BLOCK, 0), vocab) if i != tokens.eos)
    thinker_hidden = int(talker.get("thinker_hidden_size") or 0)
    config = ARModelConfig.from_hf(
        text,
        family="qwen3_omni",
        part="talker",
        emits_text=False,
        suppress_token_ids=suppressed,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        code_groups=tokens.groups,
        inputs_embeds_size=thinker_hidden + 1,
        extras={"code_predictor": dict(talker["code_predictor_config"])},
        **layout,
    )
    section = config.rope.mrope_section or DEFAULT_MROPE_SECTION
    rope = dataclasses.replace(config.rope, mrope_section=section, mrope_interleaved=True)
    return dataclasses.replace(config, rope=rope)


class ResizeMLP(nn.Module):
    """Two linear layers with biases and SiLU between: transformers' (and qwen-tts') talker
    projections, ``width -> inner -> hidden``."""

    def __init__(self, inner: int, hidden: int, dtype: torch.dtype, width: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width, inner, bias=True, dtype=dtype)
        self.linear_fc2 = nn.Linear(inner, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class FrameTalker(CausalLM):
    """A talker whose step emits a frame: its first code from the head, the others from its
    ``code_predictor``; the frame's summed embeddings are its next input."""

    code_predictor: CodePredictor

    def predict_frame(
        self,
        last_hidden: torch.Tensor,
        first_codes: torch.Tensor,
        params: Sequence[Any],
        generators: Sequence[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The other codes of each row's frame and the frame's input embedding."""
        first = self.embed(first_codes)
        greedy = [p.is_greedy for p in params]
        codes, embeds = self.code_predictor.predict(last_hidden, first, greedy, generators)
        return codes, torch.stack([first, *embeds], dim=1).sum(1)


class Talker(FrameTalker):
    def __init__(
        self, config: ARModelConfig, dtype: torch.dtype = torch.float32, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(config, dtype, tp)
        width = (config.inputs_embeds_size or 1) - 1
        args = (config.intermediate_size, config.hidden_size, dtype, width)
        self.text_projection = ResizeMLP(*args)
        self.hidden_projection = ResizeMLP(*args)
        predictor = predictor_config(dict(config.extras["code_predictor"]))
        self.code_predictor = CodePredictor(predictor, config.code_groups, dtype)

    def project_embeds(self, rows: torch.Tensor) -> torch.Tensor:
        values, flagged = rows[:, :-1], rows[:, -1] > 0.5
        out = rows.new_empty(len(rows), self.config.hidden_size)
        if flagged.any():
            out[flagged] = self.hidden_projection(values[flagged])
        if not flagged.all():
            out[~flagged] = self.text_projection(values[~flagged])
        return out


def build_talker(config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None) -> Talker:
    from omnistage.models.meta import no_weight_init

    with torch.device("meta"), no_weight_init():
        return Talker(config, dtype, tp or SINGLE)


TALKER_PREFIXES = {
    "model.codec_embedding.": "model.embed_tokens.",
    "model.": "model.",
    "codec_head.": "lm_head.",
    "text_projection.": "text_projection.",
    "hidden_projection.": "hidden_projection.",
    "code_predictor.": "code_predictor.",
}


talker_rename = prefix_rename("talker", TALKER_PREFIXES, "inv_freq")


def request_setup(folder: str) -> dict[str, Any]:
    from omnistage.models.qwen3_omni.config import read_config

    tokens = TalkerTokens.from_config(read_config(folder) or {})
    return {
        "params_field": PARAMS_FIELD,
        "param_defaults": dict(TALKER_DEFAULTS),
        "stop_token_ids": [tokens.eos],
    }
