"""Settings a stage resolves when it starts, from its device and its checkpoint.

``StageConfig`` is frozen and keeps what the user asked for (``dtype: auto``); the stage works
with the copy a kind's resolver returns (``omnistage.stage.ar.resolve`` adds
``max_model_len``). ``dtype: auto`` is float32 on CPU (the CPU kernels are fastest and
batch-invariant in float32), and on CUDA the dtype the checkpoint was saved in (float32 stays
float32), with bfloat16 run as float16 on a GPU without bfloat16.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from omnistage.config import StageConfig

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def resolve_dtype(stage: StageConfig, checkpoint_dtype: str | None) -> str:
    if stage.dtype != "auto":
        return stage.dtype
    if not stage.device.startswith("cuda") or checkpoint_dtype not in ("float16", "bfloat16"):
        return "float32"
    if checkpoint_dtype == "bfloat16" and not _cuda_has_bf16(stage.device):
        return "float16"
    return checkpoint_dtype


def _cuda_has_bf16(device: str) -> bool:
    import torch

    if not torch.cuda.is_available():
        return True  # decided on the device itself; no CUDA here means nothing runs here
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    return major >= 8


def stored_dtype(folder: str | Path) -> str | None:
    """The floating dtype of the first weights file under ``folder`` (its header only)."""
    root = Path(folder)
    files = sorted(root.glob("transformer/*.safetensors")) or sorted(root.rglob("*.safetensors"))
    for file in files:
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(size, 1 << 24)))
        except (OSError, ValueError, struct.error):
            continue
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict):
                dtype = _SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
                if dtype is not None:
                    return dtype
    return None


def resolve_stored_dtype(stage: StageConfig, folder: str | Path) -> StageConfig:
    """The stage as it runs: dtype resolved from the weights stored under ``folder``."""
    return stage.model_copy(update={"dtype": resolve_dtype(stage, stored_dtype(folder))})
