"""Test-wide settings: built-in models go to a cache inside the repository (git-ignored),
so they are built once per clone and shared by every test and server process."""

import os
from pathlib import Path

os.environ.setdefault(
    "OMNISTAGE_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".omnistage-cache" / "models"),
)
