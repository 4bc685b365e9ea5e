"""Uploaded voices (vLLM-Omni's ``POST /v1/audio/voices`` and ``DELETE
/v1/audio/voices/{name}``): a reference clip (and, optionally, its transcript), or a speaker
embedding computed already (``speaker_embedding``: a JSON list of numbers, as wide as the
checkpoint's x-vector), kept under a name, which a speech request then names as its ``voice``
to clone it.

``VoiceStore`` keeps each voice as two files in its folder (``--voice-storage-dir``; default
``voices/`` beside the model cache folder): ``<name>.json`` (what ``GET /v1/audio/voices``
lists) and ``<name>.audio`` (the bytes as uploaded) or ``<name>.safetensors`` (the embedding,
float32, as vLLM-Omni keeps one), each written whole before it is renamed into place, so a restart finds every voice that was answered 200 and none half written. The
store is bounded in count (``--max-uploaded-voices``) and in each clip's bytes
(``--max-voice-upload-bytes``) and seconds (as a request's ``ref_audio``); a clip is decoded
when it is uploaded, so a bad one is a 400 naming ``audio_sample`` then, not on first use.
Names are matched without regard to case, as vLLM-Omni's; the model's own voices are refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from omnistage.entrypoints.openai.serving_speech import speaker_of
from omnistage.entrypoints.openai.speech_clips import reference_clip
from omnistage.errors import InvalidRequestError, ResourceNotFoundError
from omnistage.models.interfaces import SpeechInput

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

MAX_REF_TEXT = 1000  # characters of a clip's transcript
EMBEDDING_KEY = "speaker_embedding"  # the tensor's name in an embedding voice's file
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FORM_FIELDS = ("audio_sample", "speaker_embedding", "consent", "name", "ref_text",
                "speaker_description")  # fmt: skip


@dataclass(frozen=True)
class Voice:
    """An uploaded voice as ``GET /v1/audio/voices`` lists it (vLLM-Omni's fields)."""

    name: str
    consent: str
    created_at: int
    file_size: int
    mime_type: str
    ref_text: str | None = None
    speaker_description: str | None = None
    embedding_dim: int | None = None  # an embedding's width; None: a clip

    @property
    def suffix(self) -> str:
        """The extension of the file that holds its clip or embedding."""
        return ".safetensors" if self.embedding_dim else ".audio"

    def listed(self) -> dict[str, Any]:
        source = "direct" if self.embedding_dim else "audio"
        entry = {**asdict(self), "embedding_source": source}
        return {k: v for k, v in entry.items() if v is not None}


class VoiceStore:
    """The uploaded voices of one server: a folder of ``<name>.json`` + ``<name>.audio`` (or
    ``<name>.safetensors``)."""

    def __init__(self, folder: str | Path, max_voices: int, max_bytes: int) -> None:
        self.folder = Path(folder).expanduser()
        self.max_voices = max_voices
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        for path in sorted(self.folder.glob("*.json")):  # none before the first upload
            try:
                voice = Voice(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("skipping the uploaded voice %s: %s", path.name, exc)
                continue
            if (self.folder / f"{path.stem}{voice.suffix}").is_file():
                self._voices[path.stem] = voice

    def __len__(self) -> int:
        return len(self._voices)

    def listed(self) -> list[dict[str, Any]]:
        with self._lock:
            return [v.listed() for _, v in sorted(self._voices.items())]

    def get(self, name: str) -> Voice | None:
        return self._voices.get(name.lower())

    def audio(self, name: str) -> bytes:
        """The clip of voice ``name`` as it was uploaded."""
        return (self.folder / f"{name.lower()}.audio").read_bytes()

    def embedding(self, name: str) -> list[float]:
        """The speaker embedding of voice ``name`` as it was uploaded."""
        from safetensors.torch import load

        data = (self.folder / f"{name.lower()}.safetensors").read_bytes()
        return [float(x) for x in load(data)[EMBEDDING_KEY].tolist()]

    def add(self, voice: Voice, audio: bytes) -> None:
        """Keep ``voice`` with its file's bytes (replacing one of the same name); 400 when the
        store is full."""
        key = voice.name.lower()
        with self._lock:
            if key not in self._voices and len(self._voices) >= self.max_voices:
                raise InvalidRequestError(
                    "name", f"the server keeps at most {self.max_voices} uploaded voices "
                    "(--max-uploaded-voices): delete one first"
                )  # fmt: skip
            self.folder.mkdir(parents=True, exist_ok=True)
            _write(self.folder / f"{key}{voice.suffix}", audio)
            _write(self.folder / f"{key}.json", json.dumps(asdict(voice)).encode())
            for suffix in {".audio", ".safetensors"} - {voice.suffix}:  # a voice it replaced
                (self.folder / f"{key}{suffix}").unlink(missing_ok=True)
            self._voices[key] = voice

    def delete(self, name: str) -> bool:
        key = name.lower()
        with self._lock:
            if self._voices.pop(key, None) is None:
                return False
            for suffix in (".json", ".audio", ".safetensors"):
                (self.folder / f"{key}{suffix}").unlink(missing_ok=True)
            return True


def _write(path: Path, data: bytes) -> None:
    """``data`` as ``path``, whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def voice_store(request: Request) -> VoiceStore:
    store: VoiceStore = request.app.state.voice_store
    return store


def _builtin_voices(request: Request) -> list[str]:
    """The served model's own voices (a 400 naming ``model`` if it speaks no given text)."""
    folder, family = speaker_of(request.app.state.engine_client)
    voices: list[str] = family.speech_voices(folder)
    return voices


def _text(form: Any, name: str, *, required: bool = False, limit: int = 1000) -> str | None:
    value = form.get(name)
    if isinstance(value, UploadFile):
        raise InvalidRequestError(name, "must be a form field, not a file")
    if value is None or not str(value).strip():
        if required:
            raise InvalidRequestError(name, "is required")
        return None
    if len(value) > limit:
        raise InvalidRequestError(name, f"is longer than {limit} characters")
    return str(value)


@router.post("/v1/audio/voices")
async def upload_voice(request: Request) -> dict[str, Any]:
    """A multipart form: ``audio_sample`` (the clip) or ``speaker_embedding`` (a JSON list of
    numbers), ``name``, ``consent`` (the consent recording's id, kept as given), optional
    ``ref_text`` (the clip's transcript, for in-context cloning) and ``speaker_description``."""
    store = voice_store(request)
    form = await request.form(max_files=1, max_fields=len(_FORM_FIELDS))
    for key in form:
        if key not in _FORM_FIELDS:
            raise InvalidRequestError(key, f"is not a field of a voice upload {list(_FORM_FIELDS)}")
    name = _text(form, "name", required=True, limit=64) or ""
    if not NAME.match(name):
        raise InvalidRequestError(
            "name", "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    if name.lower() in {v.lower() for v in _builtin_voices(request)}:
        raise InvalidRequestError("name", f"{name!r} is one of the model's own voices")
    consent = _text(form, "consent", required=True) or ""
    fields: dict[str, Any] = {
        "name": name,
        "consent": consent,
        "created_at": int(time.time()),
        "speaker_description": _text(form, "speaker_description"),
    }
    sample = form.get("audio_sample")
    if form.get("speaker_embedding") is not None:
        if sample is not None:
            raise InvalidRequestError(
                "speaker_embedding", "stands for a clip: give it or audio_sample, not both"
            )
        if form.get("ref_text") is not None:
            raise InvalidRequestError(
                "ref_text", "an embedding clones with the x-vector alone: no transcript"
            )
        vector = _embedding(request, form)
        data = _embedding_file(vector)
        voice = Voice(**fields, file_size=len(data), mime_type="application/x-safetensors",
                      embedding_dim=len(vector))  # fmt: skip
        store.add(voice, data)
        return {"success": True, "voice": voice.listed()}
    if not isinstance(sample, UploadFile):
        raise InvalidRequestError(
            "audio_sample", "is required: the voice's clip, as a file (or its speaker_embedding)"
        )
    raw = await sample.read(store.max_bytes + 1)
    if len(raw) > store.max_bytes:
        raise InvalidRequestError(
            "audio_sample", f"is larger than {store.max_bytes} bytes (--max-voice-upload-bytes)"
        )
    await reference_clip(raw, "audio_sample", request.app.state.media_policy)
    voice = Voice(
        **fields,
        file_size=len(raw),
        mime_type=sample.content_type or "application/octet-stream",
        ref_text=_text(form, "ref_text", limit=MAX_REF_TEXT),
    )
    store.add(voice, raw)
    return {"success": True, "voice": voice.listed()}


def _embedding(request: Request, form: Any) -> list[float]:
    """The form's ``speaker_embedding``: a JSON list of finite numbers the served model
    clones with (checked as a speech request's would be, so a bad one is refused now)."""
    raw = _text(form, "speaker_embedding", required=True, limit=1 << 20) or ""
    try:
        vector = json.loads(raw)
    except ValueError:
        raise InvalidRequestError("speaker_embedding", "must be a JSON list of numbers") from None
    if not isinstance(vector, list) or not vector or len(vector) > 8192:
        raise InvalidRequestError("speaker_embedding", "must be a list of 1 to 8192 numbers")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
        raise InvalidRequestError("speaker_embedding", "must hold numbers only")
    vector = [float(x) for x in vector]
    if not all(math.isfinite(x) for x in vector):
        raise InvalidRequestError("speaker_embedding", "must be finite numbers")
    folder, family = speaker_of(request.app.state.engine_client)
    probe = SpeechInput("a", task_type="Base", speaker_embedding=tuple(vector))
    try:
        family.speech_prompt(folder, _encode(folder), probe)
    except InvalidRequestError as exc:
        field = "speaker_embedding" if exc.field in ("task_type", "ref_audio") else exc.field
        raise InvalidRequestError(field, exc.reason) from None
    return vector


def _encode(folder: str) -> Any:
    from omnistage.entrypoints.openai.serving_speech import _tokenizer

    return _tokenizer(folder).encode


def _embedding_file(vector: list[float]) -> bytes:
    import torch
    from safetensors.torch import save

    return save({EMBEDDING_KEY: torch.tensor(vector, dtype=torch.float32)})


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request) -> dict[str, Any]:
    if not voice_store(request).delete(name):
        raise ResourceNotFoundError("name", f"no uploaded voice {name!r}")
    return {"success": True, "message": f"Voice '{name}' deleted successfully"}
