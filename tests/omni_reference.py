"""What the omni references (tests/qwen2_5_omni_reference.py, tests/qwen3_omni_reference.py)
share: transformers' model and tokenizer cached per folder, a prompt's token ids, captured
values detached."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.bench.omni_media import quiet


@functools.lru_cache(maxsize=8)
def load_float32(model_class: str, folder: str) -> Any:
    """``transformers.<model_class>.from_pretrained(folder)`` in float32, eval mode."""
    import transformers

    with quiet():
        model = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=4)
def load_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def prompt_ids(
    folder: str | Path, prompt: str | Sequence[int] | Sequence[dict[str, Any]]
) -> list[int]:
    """Token ids for ``prompt``: ids as given; a string as one user message, or a list of
    chat messages, through the tokenizer's chat template with the generation prompt."""
    if isinstance(prompt, str):
        messages: Any = [{"role": "user", "content": prompt}]
    elif prompt and isinstance(prompt[0], dict):
        messages = list(prompt)
    else:
        return [int(i) for i in prompt]  # type: ignore[arg-type]
    tokenizer = load_tokenizer(str(folder))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def detach(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value
