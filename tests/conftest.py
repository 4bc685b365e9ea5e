"""Test-wide settings: built-in models go to a cache inside the repository (git-ignored),
so they are built once per clone and shared by every test and server process. omnistage is
imported first, so MKL runs in strict CNR mode (omnistage/batch_invariance.py) in every test
whatever module does math first, and ``F.linear`` is the row-invariant one every stage process
installs, so transformers' reference models compute as the stages do."""

import os
from pathlib import Path

import pytest

import omnistage  # noqa: F401  (sets MKL_CBWR before MKL's first call)
from omnistage.models.invariant_linear import install as install_invariant_linear

install_invariant_linear()

os.environ.setdefault(
    "OMNISTAGE_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".omnistage-cache" / "models"),
)


@pytest.fixture(scope="session")
def tiny_qwen2_5_omni_folder(tmp_path_factory):
    """One tiny Qwen2.5-Omni checkpoint (the default spec) for the modules that only read it."""
    from omnistage.models.qwen2_5_omni.tiny import DEFAULT, build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny-qwen-omni"), DEFAULT)


@pytest.fixture(scope="session")
def tiny_qwen3_omni_folder():
    """The ``tiny-qwen3-omni`` preset, built once per clone into the test cache."""
    from omnistage.models.tiny import ensure_preset

    return ensure_preset(
        "tiny-qwen3-omni", Path(os.environ["OMNISTAGE_CACHE_DIR"]) / "tiny-qwen3-omni"
    )
