"""STUB of vllm.multimodal.media.audio with a REAL decoder.

tests/helpers/media._merge_base64_audio_to_segment decodes each streamed audio chunk with
``AudioMediaIO().load_bytes(raw)``. vLLM does this with librosa (``librosa.load(BytesIO(raw),
sr=None)``: mono float32 samples at the file's own rate). Here soundfile decodes the bytes the
same way (channels averaged to mono, no resampling). A chunk that is not a decodable audio file
raises, exactly as it would with vLLM, so a malformed chunk still fails the test.
"""

from __future__ import annotations

import base64
from io import BytesIO
from pathlib import Path

import numpy as np
import soundfile as sf


class AudioMediaIO:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    def load_bytes(self, data: bytes) -> tuple[np.ndarray, float]:
        audio, sr = sf.read(BytesIO(data), dtype="float32", always_2d=True)
        return np.mean(audio, axis=1, dtype=np.float32), float(sr)

    def load_base64(self, media_type: str, data: str) -> tuple[np.ndarray, float]:
        return self.load_bytes(base64.b64decode(data))

    def load_file(self, filepath: Path) -> tuple[np.ndarray, float]:
        return self.load_bytes(Path(filepath).read_bytes())
