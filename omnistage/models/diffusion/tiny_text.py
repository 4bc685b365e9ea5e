"""Tiny text encoders and tokenizers for the tiny diffusion presets, built locally.

Real pipelines ship CLIP's byte-level BPE, T5's and UMT5's sentencepiece and Qwen2's BPE
vocabularies; a tiny preset cannot download them, so each gets a character-level tokenizer
built with the ``tokenizers`` library that keeps what the pipeline relies on: CLIP's start and
end tokens (its pooled output is read at the first end token; padding repeats it, as Stable
Diffusion's tokenizers do), T5's end token and pad id 0, Qwen2's chat template tokens. The
encoders are transformers' own classes at tiny sizes, seeded by the caller.
"""

from __future__ import annotations

from typing import Any

TEXT_DIM = 32  # the hidden size of every tiny text encoder
CLIP_MAX_LENGTH = 77  # CLIP's context, as the real tokenizers say


def _char_vocab(specials: list[str]) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(specials)}
    for code in range(32, 127):
        vocab.setdefault(chr(code).lower(), len(vocab))
    return vocab


def clip_tokenizer() -> Any:
    """Characters between ``<|startoftext|>`` and ``<|endoftext|>``, padded with the end
    token (ids: unk 0, start 1, end 3; CLIP's pooling takes the first end token)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|unk|>", "<|startoftext|>", "<|pad|>", "<|endoftext|>"]
    vocab = _char_vocab(specials)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 3)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        model_max_length=CLIP_MAX_LENGTH,
    )


def clip_text_encoder(tokenizer: Any, *, with_projection: bool = False) -> Any:
    """A two-layer ``CLIPTextModel`` (``CLIPTextModelWithProjection`` for SD3)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=2 * TEXT_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=TEXT_DIM,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


def t5_text_encoder(tokenizer: Any, *, umt5: bool = False, d_model: int = TEXT_DIM) -> Any:
    """A two-layer ``T5EncoderModel`` (``UMT5EncoderModel`` for Wan)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class: Any = UMT5Config if umt5 else T5Config
    model_class: Any = UMT5EncoderModel if umt5 else T5EncoderModel
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return model_class(config).eval()


def qwen_tokenizer() -> Any:
    """Characters plus Qwen2's chat tokens (``<|im_start|>``, ``<|im_end|>``), padded with
    ``<|endoftext|>``; no start or end token is added, as Qwen2's tokenizer adds none."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = _char_vocab(specials)
    vocab["\n"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=2048,
    )


def qwen2_5_vl_text_encoder(tokenizer: Any) -> Any:
    """A two-layer ``Qwen2_5_VLForConditionalGeneration`` (Qwen-Image reads its last hidden
    states; the tiny vision tower is never run)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    fields: dict[str, Any] = dict(
        text_config={
            "hidden_size": TEXT_DIM,
            "intermediate_size": 2 * TEXT_DIM,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIM,
        },
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        vision_start_token_id=len(tokenizer) + 1,
        vision_end_token_id=len(tokenizer) + 2,
        image_token_id=len(tokenizer) + 4,
        video_token_id=len(tokenizer) + 5,
    )
    config = Qwen2_5_VLConfig(**fields)
    return Qwen2_5_VLForConditionalGeneration(config).eval()
