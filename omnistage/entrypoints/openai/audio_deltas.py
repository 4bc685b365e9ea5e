"""Speech in a streamed chat reply, in OpenAI's shape: ``delta.audio`` chunks carrying the
audio's ``id``, then its ``transcript``, base64 ``data`` pieces and finally ``expires_at``.

A pipeline that speaks chunk by chunk (a streamed edge) sends each chunk's samples as soon as
they exist; otherwise the whole utterance comes at the end. Decoding every ``data`` piece and
joining the bytes gives the audio: raw 16-bit PCM for ``format: "pcm16"`` (or ``"pcm"``);
for ``"wav"`` a WAV file whose header comes first — when streamed, with its sizes set to
0xFFFFFFFF ("length unknown", as streaming WAV writers mark it), since the length is not
known yet (Python's ``wave`` then reads it as 24 hours long: read its frames to the end, or
ask for ``pcm16``). The compressed formats (``flac``, ``mp3``, ``opus``) come whole, once
the utterance is complete. A reply that is not streamed carries a WAV with its true sizes.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from omnistage.engine.outputs import OmniAudio
from omnistage.entrypoints.openai.audio_formats import JOINABLE, encode_audio
from omnistage.entrypoints.openai.replies import AudioReply, new_id, now

AUDIO_CHUNK_BYTES = 48 * 1024  # raw bytes per delta.audio piece (base64: 64 KiB)
AUDIO_TTL_S = 3600  # OpenAI's expires_at: how long a client may refer to the audio
UNKNOWN_LENGTH = 0xFFFFFFFF


def audio_reply(audio: OmniAudio, transcript: str, audio_format: str) -> AudioReply:
    """OpenAI's ``message.audio``: the file (or raw pcm16) of ``audio_format``, base64."""
    raw = encode_audio(audio, audio_format)
    return AudioReply(
        id=new_id("audio"),
        data=base64.b64encode(raw).decode("ascii"),
        expires_at=now() + AUDIO_TTL_S,
        transcript=transcript,
    )


def streaming_wav_header(sample_rate: int) -> bytes:
    """A mono 16-bit PCM WAV header whose RIFF and data sizes say "unknown"."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", UNKNOWN_LENGTH)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", UNKNOWN_LENGTH)
    )


def _pieces(audio_id: str, raw: bytes) -> list[dict[str, Any]]:
    return [
        {"id": audio_id, "data": base64.b64encode(raw[i : i + AUDIO_CHUNK_BYTES]).decode("ascii")}
        for i in range(0, len(raw), AUDIO_CHUNK_BYTES)
    ]


class AudioDeltas:
    """The ``delta.audio`` payloads of one streamed reply, per choice."""

    def __init__(self, audio_format: str) -> None:
        self.audio_format = audio_format
        self._streamed: dict[int, str] = {}  # choice -> its audio's id, once a piece went out

    def piece(self, index: int, audio: OmniAudio, transcript: str) -> list[dict[str, Any]]:
        """A chunk of speech as soon as it exists (the first also names the transcript); a
        compressed format's comes whole when the speech is complete (``finished``)."""
        if len(audio.samples) == 0 or self.audio_format not in JOINABLE:
            return []
        raw = audio.pcm16()
        out: list[dict[str, Any]] = []
        if index not in self._streamed:
            self._streamed[index] = new_id("audio")
            out.append({"id": self._streamed[index], "transcript": transcript})
            if self.audio_format == "wav":
                raw = streaming_wav_header(audio.sample_rate) + raw
        return out + _pieces(self._streamed[index], raw)

    def finished(self, index: int, audio: OmniAudio, transcript: str) -> list[dict[str, Any]]:
        """A choice's speech is complete: its expiry after streamed pieces, or the whole
        utterance when none was streamed."""
        audio_id = self._streamed.get(index)
        if audio_id is None:
            answer = audio_reply(audio, transcript, self.audio_format)
            raw = base64.b64decode(answer.data)
            first = {"id": answer.id, "transcript": transcript}
            expiry = {"id": answer.id, "expires_at": answer.expires_at}
            return [first, *_pieces(answer.id, raw), expiry]
        return [{"id": audio_id, "expires_at": now() + AUDIO_TTL_S}]
