import pytest
from pydantic import ValidationError

from omnistage.cli import build_parser
from omnistage.config import ConfigError
from omnistage.entrypoints.openai.server_config import ServerConfig


def test_every_server_setting_has_a_flag_with_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.dest: a for a in serve._actions if a.dest != "help"}
    assert set(flags) == set(ServerConfig.model_fields)
    assert all(a.help for a in flags.values())


def test_stage_overrides_reach_every_stage():
    config = ServerConfig(
        pipeline="tiny-chat", enable_sleep_mode=True, idle_sleep_s=30, dtype="float32"
    )
    pipeline = config.pipeline_config()
    assert all(s.enable_sleep_mode and s.idle_sleep_s == 30 for s in pipeline.stages)


def test_idle_sleep_without_sleep_mode_is_refused_naming_it():
    with pytest.raises(ConfigError, match="idle_sleep_s"):
        ServerConfig(pipeline="tiny-chat", idle_sleep_s=30).pipeline_config()


def test_only_one_model_source():
    with pytest.raises(ValidationError, match="only one of"):
        ServerConfig(pipeline="tiny-chat", model="/some/checkpoint")


def test_model_path_becomes_one_ar_stage(tmp_path):
    pipeline = ServerConfig(model=str(tmp_path), enable_sleep_mode=True).pipeline_config()
    (stage,) = pipeline.stages
    assert stage.kind == "ar" and stage.model == str(tmp_path) and stage.enable_sleep_mode
