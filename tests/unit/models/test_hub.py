"""A hub id is served from the local Hugging Face cache, never downloaded."""

from __future__ import annotations

import pytest

from omnistage.config import ConfigError
from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.models.hub import hf_hub_cache, resolve_model_path


def cache_snapshot(cache, repo_id: str, commit: str = "abc123"):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    return snapshot


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_HUB_CACHE": "/x/hub"}, "/x/hub"),
        ({"HF_HOME": "/y"}, "/y/hub"),
        ({"XDG_CACHE_HOME": "/z"}, "/z/huggingface/hub"),
    ],
)
def test_the_cache_location_follows_huggingface_hub(monkeypatch, env, expected):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert str(hf_hub_cache()) == expected


def test_a_cached_hub_id_is_its_snapshot_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = cache_snapshot(tmp_path, "Org/Tiny-Model")
    assert resolve_model_path("Org/Tiny-Model") == str(snapshot)
    config = ServerConfig(model="Org/Tiny-Model")
    assert config.model_name == "Org/Tiny-Model"
    (stage,) = config.pipeline_config().stages
    assert stage.model == str(snapshot)


def test_an_uncached_hub_id_says_omnistage_does_not_download_and_where_it_looked(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "local" in message and "never downloads" in message
    assert str(tmp_path / "models--Qwen--Qwen2.5-0.5B-Instruct") in message


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint folder"):
        resolve_model_path(str(tmp_path / "nope"))
