import pytest
from pydantic import ValidationError

from omnistage.cli import build_parser
from omnistage.config import ConfigError
from omnistage.entrypoints.openai.server_config import ServerConfig


def test_every_server_setting_has_a_flag_with_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.dest: a for a in serve._actions if a.dest not in ("help", "model_tag")}
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


DECODER_CONFIG = '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}'


def test_model_path_becomes_one_ar_stage(tmp_path):
    (tmp_path / "config.json").write_text(DECODER_CONFIG)
    pipeline = ServerConfig(model=str(tmp_path), enable_sleep_mode=True).pipeline_config()
    (stage,) = pipeline.stages
    assert stage.kind == "ar" and stage.model == str(tmp_path) and stage.enable_sleep_mode


def test_a_model_the_registry_does_not_know_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ConfigError, match=r"'GPT2LMHeadModel'\] is not a supported model.*"):
        ServerConfig(model=str(tmp_path)).pipeline_config()
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM"):
        ServerConfig(model=str(tmp_path)).pipeline_config()
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        ServerConfig(model=str(tmp_path)).pipeline_config()


@pytest.mark.parametrize("key", ["", " ", "secret "])
@pytest.mark.parametrize("field", ["api_key", "control_api_key"])
def test_blank_keys_are_refused_instead_of_disabling_auth(field, key):
    with pytest.raises(ValidationError, match=field):
        ServerConfig(pipeline="tiny-chat", **{field: key})


@pytest.mark.parametrize("env", ["OMNISTAGE_API_KEY", "OMNISTAGE_CONTROL_API_KEY"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_key_variable_fails_as_the_flag_does(capsys, monkeypatch, env, value):
    from omnistage.cli import main

    monkeypatch.setenv(env, value)
    assert main(["serve", "--pipeline", "tiny-chat"]) == 2
    err = capsys.readouterr().err
    assert f"${env}" in err and len(err.strip().splitlines()) == 1


def test_an_empty_api_key_flag_fails_with_one_line(capsys):
    from omnistage.cli import main

    assert main(["serve", "--pipeline", "tiny-chat", "--api-key", ""]) == 2
    assert "--api-key" in capsys.readouterr().err


def _app_client(**settings):
    from fastapi.testclient import TestClient

    from omnistage.entrypoints.openai.api_server import build_app
    from tests.unit.entrypoints.serve.conftest import FakeEngine

    config = ServerConfig(pipeline="tiny-chat", **settings)
    return TestClient(build_app(config, engine_client=FakeEngine()))


def test_the_schema_follows_the_data_key_and_no_cdn_pages_are_served():
    with _app_client(api_key="data-key") as client:
        assert client.get("/openapi.json").status_code == 401
        schema = client.get("/openapi.json", headers={"Authorization": "Bearer data-key"})
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
        assert client.get("/docs").status_code == 404
        assert client.get("/redoc").status_code == 404


def test_bodies_over_the_limit_are_413_naming_the_setting():
    with _app_client(max_request_body_bytes=1000) as client:
        reply = client.post("/v1/chat/completions", content=b"x" * 1001)
        assert reply.status_code == 413
        assert "--max-request-body-bytes" in reply.json()["error"]["message"]
        small = client.post("/v1/chat/completions", content=b"{not json")
        assert small.status_code == 400  # under the limit: the route's own validation answers


def test_the_default_body_limit_takes_one_medium_of_the_media_limit_in_base64():
    config = ServerConfig(pipeline="tiny-chat")
    assert config.request_body_limit >= -(-config.max_media_bytes // 3) * 4  # a 32 MiB WAV inline
    smaller = ServerConfig(pipeline="tiny-chat", max_media_bytes=3 * 1024 * 1024)
    assert 4 * 1024 * 1024 <= smaller.request_body_limit < config.request_body_limit
    assert ServerConfig(max_request_body_bytes=1000).request_body_limit == 1000  # as given


def test_a_pipeline_file_is_served_under_its_own_name(tmp_path):
    """examples/pipeline.yaml says ``name: my-omni`` is the model id: /v1/models reported the
    file's stem and "model": "my-omni" was a 404."""
    from pathlib import Path

    example = Path(__file__).parents[3] / "examples" / "pipeline.yaml"
    assert ServerConfig(config=str(example)).model_names == ["my-omni"]
    unnamed = tmp_path / "mine.yaml"
    unnamed.write_text("stages: []\n")
    assert ServerConfig(config=str(unnamed)).model_name == "mine"
    named = ServerConfig(config=str(example), served_model_name=["other"])
    assert named.model_names == ["other"]


def test_the_per_stage_flags_are_the_stage_fields():
    """Each flag that sets a stage setting on every stage is generated from that setting (a
    stage field, or a kind's option): its bounds and description, and ``stage_overrides``
    gives it by its name."""
    import pydantic

    from omnistage.config import KIND_OPTIONS, AROptions, StageConfig, option_kinds
    from omnistage.entrypoints.openai.server_config import STAGE_FLAGS

    def bounds(info):
        return sorted(
            repr(m) for m in info.metadata if type(m).__name__ in ("Gt", "Ge", "Lt", "Le")
        )

    assert bounds(AROptions.model_fields["max_num_seqs"]) == ["Gt(gt=0)"]
    for flag in STAGE_FLAGS:
        kinds = option_kinds(flag)
        fields = KIND_OPTIONS[kinds[0]].model_fields if kinds else StageConfig.model_fields
        ours, theirs = ServerConfig.model_fields[flag], fields[flag]
        assert ours.description.startswith(theirs.description), flag
        assert bounds(ours) == bounds(theirs), flag
    with pytest.raises(pydantic.ValidationError, match="max_num_seqs"):
        ServerConfig(max_num_seqs=0)
    overrides = ServerConfig(kv_cache_memory="1MiB", max_num_seqs=3).stage_overrides()
    assert overrides["kv_cache_memory"] == 1 << 20 and overrides["max_num_seqs"] == 3
