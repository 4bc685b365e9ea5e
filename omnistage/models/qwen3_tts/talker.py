"""Qwen3-TTS's talker: a dense Qwen3 decoder over codec ids whose step emits a frame of
``num_code_groups`` codes — the first from its ``codec_head``, the others from its code
predictor — and takes the frame's summed embeddings plus the step's trailing text row as its
next input (``prompt.embed_prompt`` builds its prompt rows and trailing rows; they reach the
stage as a request's ``prompt_embeds`` and ``decode_embeds``, already in the talker's width).

Its text side: ``text_embedding`` and ``text_projection`` (``embed_text``). Its rotary
positions are the three identical rows of a multimodal rope, i.e. plain 1-D positions. The
code predictor is Qwen3-Omni's with talker-wide embedding tables, a projection into its own
width (``small_to_mtp_projection``) and the checkpoint's own sampling of the other codes.
Checkpoint names as ``Qwen3TTSForConditionalGeneration`` saves them (``talker.*``).

A Base checkpoint's talker also holds what clones a voice (``adopt_components``): the speaker
encoder (``speaker.py``, tag ``speaker_encoder``) and the speech tokenizer's encoder
(``codec_encoder.py``, tag ``codec_encoder``), each in its own arena tag (they sleep and wake
with the stage, outside the decoder's ``weights``). A clone's spec carries its clip
(``ref_audio``: float32 samples at 24 kHz); the x-vector fills the speaker row and, in context
(ICL), the clip's codes fill the reference frames and are handed to the next stage before the
talker's own (``embed_prompt_spec``'s context ids).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, choose_codes, predictor_config
from omnistage.models.qwen3_omni.talker import FrameTalker, ResizeMLP
from omnistage.models.qwen3_omni.weights import prefix_rename
from omnistage.models.qwen3_tts.config import (
    SAMPLING_DEFAULTS,
    CodecIds,
    TextIds,
    checkpoint_codec_ids,
    checkpoint_sampling,
    checkpoint_text_ids,
)
from omnistage.models.qwen3_tts.prompt import SPEAKER_VECTOR, TalkerPrompt, embed_prompt
from omnistage.models.tensor_parallel import SINGLE, TPGroup

SUPPRESSED_BLOCK = 1024  # the talker never draws the top 1024 ids but codec_eos
SPEAKER_TAG = "speaker_encoder"  # a Base talker's arena tags beside ``weights``
CODEC_TAG = "codec_encoder"


def talker_config(raw: dict[str, Any]) -> ARModelConfig:
    """The talker's decoder config from ``config.json`` (``CheckpointError`` naming a key)."""
    talker = dict(raw.get("talker_config") or {})
    predictor = talker.get("code_predictor_config")
    if not talker or not isinstance(predictor, dict):
        raise CheckpointError("config.json: talker_config lacks code_predictor_config")
    scaling = talker.pop("rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise CheckpointError(
            f"config.json: talker_config.rope_scaling {scaling!r} is not supported "
            "(the talker's positions are 1-D: only the default rope)"
        )
    try:
        vocab, eos = int(talker["vocab_size"]), int(talker["codec_eos_token_id"])
        extras = {
            "code_predictor": dict(predictor),
            "text_vocab_size": int(talker["text_vocab_size"]),
            "text_hidden_size": int(talker["text_hidden_size"]),
            "text_ids": dataclasses.asdict(checkpoint_text_ids(raw)),
            "codec_ids": dataclasses.asdict(checkpoint_codec_ids(raw)),
            "variant": raw.get("tts_model_type"),
            "sampling": checkpoint_sampling(raw.get("_name_or_path")),
        }
        groups = int(talker["num_code_groups"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json: talker_config lacks or mistypes {exc}") from None
    bias = bool(talker.get("attention_bias", False))
    return ARModelConfig.from_hf(
        talker,
        family="qwen3_tts",
        part="talker",
        emits_text=False,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        suppress_token_ids=tuple(
            i for i in range(max(vocab - SUPPRESSED_BLOCK, 0), vocab) if i != eos
        ),
        code_groups=groups,
        extras=extras,
    )


class TTSCodePredictor(CodePredictor):
    """Qwen3-Omni's predictor with ``embed_width``-wide tables (the talker's), a projection
    into its own width, and sampled codes drawn as the checkpoint's ``subtalker_*`` say."""

    def __init__(
        self,
        config: ARModelConfig,
        groups: int,
        dtype: torch.dtype,
        embed_width: int,
        sampling: dict[str, Any],
    ) -> None:
        super().__init__(config, groups, dtype)
        self.model.codec_embedding = nn.ModuleList(
            [nn.Embedding(config.vocab_size, embed_width, dtype=dtype) for _ in range(groups - 1)]
        )
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(embed_width, config.hidden_size, bias=True, dtype=dtype)
            if embed_width != config.hidden_size
            else nn.Identity()
        )
        self.sampling = sampling

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.small_to_mtp_projection(x)

    def choose(
        self, logits: torch.Tensor, greedy: Sequence[bool], generators: Sequence[torch.Generator]
    ) -> torch.Tensor:
        s = self.sampling
        greedy = [g or not s["subtalker_dosample"] for g in greedy]
        return choose_codes(
            logits, greedy, generators,
            top_k=int(s["subtalker_top_k"]), top_p=float(s["subtalker_top_p"]),
            temperature=float(s["subtalker_temperature"]),
        )  # fmt: skip


class Talker(FrameTalker):
    def __init__(
        self, config: ARModelConfig, dtype: torch.dtype = torch.float32, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(config, dtype, tp)
        extras = config.extras
        text_width = int(extras["text_hidden_size"])
        self.text_embedding = nn.Embedding(int(extras["text_vocab_size"]), text_width, dtype=dtype)
        self.text_projection = ResizeMLP(text_width, config.hidden_size, dtype, text_width)
        predictor = predictor_config(dict(extras["code_predictor"]))
        sampling = {**SAMPLING_DEFAULTS, **dict(extras.get("sampling") or {})}
        self.code_predictor = TTSCodePredictor(
            predictor, config.code_groups, dtype, config.hidden_size, sampling
        )
        self.weight_dtype = dtype
        # a Base checkpoint's encoders (not submodules: their tags are their own)
        self.clone_parts: dict[str, Any] = {}

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text tokens' rows in the talker's width."""
        return self.text_projection(self.text_embedding(ids))

    # -- a Base checkpoint's encoders ------------------------------------------------------

    @property
    def component_tags(self) -> list[str]:
        return [part.tag for part in self.clone_parts.values()]

    def adopt_components(self, arena: Any, folder: Path, *, load: bool) -> None:
        """A Base checkpoint's speaker encoder and speech encoder, each adopted under its own
        tag (and loaded with ``load``); nothing for another variant."""
        if self.config.extras.get("variant") != "base":
            return
        from omnistage.models.qwen3_tts.codec_encoder import CodecEncoder
        from omnistage.models.qwen3_tts.speaker import SpeakerEncoder, encoder_config

        where = folder / "config.json"
        raw = json.loads(where.read_text())
        speaker = encoder_config(raw, str(where))
        if speaker.enc_dim != self.config.hidden_size:
            raise CheckpointError(
                f"{where}: speaker_encoder_config enc_dim {speaker.enc_dim} is not the talker's "
                f"hidden_size {self.config.hidden_size} (the x-vector is a talker row)"
            )
        self.clone_parts = {
            "speaker": SpeakerEncoder(speaker, arena, dtype=self.weight_dtype, tag=SPEAKER_TAG),
            "codec": CodecEncoder(folder, arena, load=False, tag=CODEC_TAG),
        }
        if load:
            self.load_components(folder, self.component_tags)

    def load_components(self, path: Path, tags: list[str]) -> int:
        """Refill the encoders whose tags are in ``tags`` from a checkpoint folder (a weight
        source that is not one, a trainer's file, carries none of theirs); returns the bytes."""
        if not self.clone_parts or not (Path(path) / "config.json").is_file():
            return 0
        return sum(
            part.load_weights(path) for part in self.clone_parts.values() if part.tag in tags
        )

    def frame_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Reference frames ``[T, groups]`` as the package's ``generate_icl_prompt`` embeds
        them: each codebook's embedding (the first the talker's, code ``i`` the predictor's
        table ``i - 1``), stacked ``[T, groups, hidden]`` and summed: ``[T, hidden]``."""
        tables = [self.model.embed_tokens, *self.code_predictor.model.codec_embedding]
        columns = [table(codes[:, i : i + 1]) for i, table in enumerate(tables)]
        return torch.cat(columns, dim=1).sum(1)

    def embed_prompt_spec(
        self, spec: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A speech request's prompt rows, trailing text rows (``prompt.embed_prompt``) and
        the codes the next stage decodes before the talker's (an ICL clone's reference)."""
        extras = self.config.extras
        prompt = TalkerPrompt.from_spec(
            spec, TextIds(**extras["text_ids"]), CodecIds(**extras["codec_ids"])
        )
        if SPEAKER_VECTOR not in prompt.prefix:
            return (*embed_prompt(prompt, self.embed_text, self.embed), [])
        if not self.clone_parts:
            raise InvalidRequestError("ref_audio", "this checkpoint clones no voice (not Base)")
        if "speaker_embedding" in spec:  # given: an x-vector clone without a clip
            if prompt.ref_frames:
                raise InvalidRequestError(
                    "prompt_spec.ref_frames", "a given speaker_embedding comes with no clip"
                )
            vector = given_embedding(spec, self.config.hidden_size)
            device = self.model.embed_tokens.weight.device
            rows, trailing = embed_prompt(
                prompt, self.embed_text, self.embed, vector.to(device), None
            )
            return rows, trailing, []
        clip = reference_clip(spec)
        vector = self.clone_parts["speaker"].embed(clip)
        frames, context = None, []
        if prompt.ref_frames:
            codes = self.clone_parts["codec"].encode(clip)
            if len(codes) != prompt.ref_frames:
                raise InvalidRequestError(
                    "prompt_spec.ref_frames",
                    f"the clip makes {len(codes)} frames, the spec says {prompt.ref_frames}",
                )
            device = self.model.embed_tokens.weight.device
            frames = self.frame_rows(codes.to(device))
            context = codes.reshape(-1).tolist()  # frame-major, as the talker's own
        rows, trailing = embed_prompt(prompt, self.embed_text, self.embed, vector, frames)
        return rows, trailing, context


def reference_clip(spec: dict[str, Any]) -> np.ndarray:
    """A clone spec's clip: ``ref_audio``, float32 little-endian samples at 24 kHz."""
    raw = spec.get("ref_audio")
    if not isinstance(raw, bytes | bytearray) or not raw or len(raw) % 4:
        raise InvalidRequestError("prompt_spec.ref_audio", "must be float32 samples (bytes)")
    clip = np.frombuffer(bytes(raw), dtype="<f4")
    if not np.isfinite(clip).all():
        raise InvalidRequestError("prompt_spec.ref_audio", "has samples that are not finite")
    return clip.astype(np.float32)


def given_embedding(spec: dict[str, Any], width: int) -> torch.Tensor:
    """A clone spec's given x-vector: ``speaker_embedding``, ``width`` float32 values."""
    raw = spec.get("speaker_embedding")
    if not isinstance(raw, bytes | bytearray) or len(raw) != 4 * width:
        raise InvalidRequestError(
            "prompt_spec.speaker_embedding", f"must be {width} float32 values (bytes)"
        )
    vector = np.frombuffer(bytes(raw), dtype="<f4")
    if not np.isfinite(vector).all():
        raise InvalidRequestError("prompt_spec.speaker_embedding", "has values that are not finite")
    return torch.from_numpy(vector.astype(np.float32))


def build_talker(config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None) -> Talker:
    from omnistage.models.meta import no_weight_init

    if tp is not None and tp.size > 1:
        raise CheckpointError("tensor_parallel_size: a Qwen3-TTS talker runs on one rank")
    with torch.device("meta"), no_weight_init():
        return Talker(config, dtype, SINGLE)


TALKER_PREFIXES = {
    "model.codec_embedding.": "model.embed_tokens.",
    "model.text_embedding.": "text_embedding.",
    "model.": "model.",
    "codec_head.": "lm_head.",
    "text_projection.": "text_projection.",
    "code_predictor.": "code_predictor.",
}

talker_rename = prefix_rename("talker", TALKER_PREFIXES, "inv_freq")
