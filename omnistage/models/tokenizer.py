"""A checkpoint's tokenizer without transformers: ``tokenizer.json`` through the ``tokenizers``
library, the chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``) rendered
with jinja2 as transformers renders it, and incremental detokenization into UTF-8-safe deltas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer

from omnistage.errors import InvalidRequestError

if TYPE_CHECKING:
    import jinja2

# Prompt tokens kept as decoding context: some decoders (SentencePiece-style) drop a leading
# space unless the text starts mid-stream.
_DETOKENIZE_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """Tokens in tokenizer_config are plain strings or serialized ``AddedToken`` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        by_name = {t["name"]: t["template"] for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    json_file = folder / "chat_template.json"  # processors' (Qwen2.5-Omni's) own file
    if template is None and json_file.is_file():
        try:
            template = json.loads(json_file.read_text()).get("chat_template")
        except (ValueError, AttributeError):
            template = None
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


class Tokenizer:
    """Encode, decode and render chats for one checkpoint folder."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos = set(extra_eos_token_ids)
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = (
            backend.token_to_id(bos_token) if bos_token is not None else None
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` and the eos/bos/template facts from a checkpoint folder.

        The eos ids are the union of ``generation_config.json``, ``config.json`` and the
        tokenizer config's ``eos_token``: any of them ends a generation.
        """
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        config = _read_json(folder / "tokenizer_config.json")
        eos_ids = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        eos_ids += _ids(_read_json(folder / "config.json").get("eos_token_id"))
        return cls(
            BackendTokenizer.from_file(str(file)),
            chat_template=_chat_template(folder, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            extra_eos_token_ids=eos_ids,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its longest vocabulary entry,
        added tokens included): a text of ``n`` characters has at least ``n /
        max_token_chars`` tokens, known without tokenizing it."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        # jinja2 is imported here: stage processes detokenize but never render templates.
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise InvalidRequestError(
                "messages", "this model has no chat template (tokenizer_config.json)"
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for ``messages``; template errors raise ``InvalidRequestError``."""
        if not isinstance(messages, Sequence) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages", "must be a list of {'role', 'content'} dicts")
        import jinja2

        try:
            return self._compiled_template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            # TypeError: a message the template cannot handle, e.g. ``"content": None``.
            raise InvalidRequestError("messages", f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The template writes the special tokens itself, as transformers' apply_chat_template.
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never split a UTF-8 character.

    A delta is released only when the decoded window does not end in U+FFFD (an incomplete
    byte sequence); ``flush`` releases whatever is left when the generation ends, so the
    concatenated deltas equal ``decode`` of all generated ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_DETOKENIZE_CONTEXT_TOKENS:])
        if self._decode(0).endswith(_REPLACEMENT_CHAR):
            # A prompt ending mid-character would swallow the generated bytes completing it.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became complete."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]
