"""Where a ``--model`` argument's checkpoint is on this machine.

omnistage never downloads (servers run where no hub is reachable): a model is a local
folder, or a Hugging Face hub id (``Org/Name``) whose snapshot is already in the local
Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), as ``huggingface-cli download`` or ``transformers`` left it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omnistage.config import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The folder of ``repo_id``'s cached snapshot (``revision``: a ref or commit), if any."""
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    snapshots = sorted(
        (p for p in (repo / "snapshots").glob("*") if p.is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    return snapshots[-1] if snapshots else None


def resolve_model_path(model: str, key: str = "model") -> str:
    """The local folder of ``model`` (a folder or a cached hub id); ``ConfigError`` naming
    ``key`` otherwise."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path)
    if is_hub_id(model):
        snapshot = cached_snapshot(model)
        if snapshot is not None:
            return str(snapshot)
        where = hf_hub_cache() / ("models--" + model.replace("/", "--"))
        raise ConfigError(
            f"{key}: {model!r} is not a local folder, and omnistage serves local checkpoints "
            f"only (it never downloads). It is not in the Hugging Face cache either ({where}): "
            f"download it there where a network is reachable (`huggingface-cli download "
            f"{model}`, then copy the cache), or pass the checkpoint's folder."
        )
    raise ConfigError(f"{key}: no such checkpoint folder: {model}")
