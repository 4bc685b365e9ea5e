"""Test-wide settings: built-in models go to a cache inside the repository (git-ignored),
so they are built once per clone and shared by every test and server process. omnistage is
imported first, so MKL runs in strict CNR mode (omnistage/batch_invariance.py) in every test
whatever module does math first."""

import os
from pathlib import Path

import omnistage  # noqa: F401  (sets MKL_CBWR before MKL's first call)

os.environ.setdefault(
    "OMNISTAGE_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".omnistage-cache" / "models"),
)
