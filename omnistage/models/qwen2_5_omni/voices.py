"""The voices of a Qwen2.5-Omni folder (``spk_dict.pt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError

SPEAKERS_FILE = "spk_dict.pt"
DEFAULT_VOICE = "Chelsie"  # transformers' default speaker


def default_voice(voices: list[str]) -> str:
    return DEFAULT_VOICE if DEFAULT_VOICE in voices else voices[0]


def load_speakers(folder: str | Path) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``: per voice ``cond``, ``ref_mel`` and ``bos_token`` (loaded with
    ``weights_only=True``: tensors and plain values only, never code)."""
    import torch

    path = Path(folder) / SPEAKERS_FILE
    try:
        speakers = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"no {SPEAKERS_FILE} (the voices) in {folder}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(speakers, dict) or not speakers:
        raise CheckpointError(f"{path} holds no voices")
    for name, entry in speakers.items():
        if not isinstance(entry, dict) or not {"cond", "ref_mel", "bos_token"} <= set(entry):
            raise CheckpointError(f"{path}: voice {name!r} lacks cond, ref_mel or bos_token")
    return speakers


def voice_bos_tokens(folder: str | Path) -> dict[str, int]:
    """Each voice's text bos id (what the talker's reply starts with)."""
    return {str(name): int(entry["bos_token"]) for name, entry in load_speakers(folder).items()}
