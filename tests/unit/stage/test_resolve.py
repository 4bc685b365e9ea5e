"""What a stage resolves at start-up: ``max_model_len`` from the checkpoint (never above its
limit) and ``dtype: auto`` from the device and the checkpoint."""

from __future__ import annotations

import pytest

from omnistage.config import ConfigError, StageConfig
from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.models.ar_config import ARModelConfig
from omnistage.stage import resolve
from omnistage.stage.resolve import resolve_dtype, stored_dtype
from tests.unit.stage.ar.helpers import build_micro, make_engine


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A checkpoint with max_position_embeddings 512."""
    return build_micro(tmp_path_factory.mktemp("micro"))


def test_max_model_len_defaults_to_the_checkpoints_limit(micro):
    assert ARModelConfig.from_pretrained(micro).max_position_embeddings == 512
    engine = make_engine(micro, max_model_len=None)
    try:
        assert engine.max_model_len == 512 and engine.info().max_model_len == 512
    finally:
        engine.shutdown()


def test_max_model_len_above_the_checkpoints_limit_is_refused_before_any_stage_starts(micro):
    with pytest.raises(
        ConfigError, match=r"max_model_len \(1024\).*max_position_embeddings \(512\)"
    ):
        ServerConfig(model=str(micro), max_model_len=1024).pipeline_config()
    with pytest.raises(ConfigError, match="max_model_len"):
        make_engine(micro, max_model_len=1024)
    assert ServerConfig(model=str(micro), max_model_len=512).pipeline_config()


def stage(device: str = "cpu", dtype: str = "auto") -> StageConfig:
    return StageConfig(stage_id=0, kind="ar", model="m", device=device, dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "checkpoint", "has_bf16", "expected"),
    [
        ("cpu", "bfloat16", True, "float32"),
        ("cpu", "float16", True, "float32"),
        ("cuda", "bfloat16", True, "bfloat16"),
        ("cuda:0", "bfloat16", False, "float16"),
        ("cuda", "float16", True, "float16"),
        ("cuda", "float32", True, "float32"),
        ("cuda", None, True, "float32"),
    ],
)
def test_auto_dtype(monkeypatch, device, checkpoint, has_bf16, expected):
    monkeypatch.setattr(resolve, "_cuda_has_bf16", lambda _device: has_bf16)
    assert resolve_dtype(stage(device), checkpoint) == expected


def test_an_explicit_dtype_is_kept():
    assert resolve_dtype(stage("cpu", "bfloat16"), "float32") == "bfloat16"
    assert stage("cpu", "half").dtype == "float16"


def test_the_checkpoint_dtype_is_read_from_config_and_weights(tmp_path):
    import json

    from tests.unit.models.hf_checkpoints import build_checkpoint

    _, folder = build_checkpoint("qwen3", tmp_path / "q")
    raw = json.loads((folder / "config.json").read_text())
    saved = (raw.get("dtype") or raw.get("torch_dtype")).removeprefix("torch.")
    assert ARModelConfig.from_pretrained(folder).torch_dtype == saved
    assert stored_dtype(folder) == "float32"
    assert stored_dtype(tmp_path / "empty") is None
