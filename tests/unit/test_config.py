import pytest

from omnistage.config import ConfigError, load_pipeline_config, parse_pipeline_config

AR = {"stage_id": 0, "kind": "ar", "model": "ckpt"}


def test_valid_two_stage_pipeline_from_yaml(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: demo\nstages:\n"
        "  - {stage_id: 0, kind: ar, model: a, enable_sleep_mode: true}\n"
        "  - {stage_id: 1, kind: diffusion, model: b, input_from: 0, input_processor: thinker_hidden_to_image_cond}\n"
    )
    config = load_pipeline_config(path)
    assert config.num_stages == 2 and config.stages[1].input_from == 0


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ({**AR, "max_num_seqs": 0}, "stages.0.max_num_seqs"),
        ({**AR, "kind": "GAN!"}, "stages.0.kind"),
        ({**AR, "device": "tpu"}, "stages.0.device"),
        ({**AR, "dtype": "int3"}, "stages.0.dtype"),
        ({**AR, "surprise": 1}, "stages.0.surprise: unknown key"),
        ({"stage_id": 0, "kind": "ar"}, "stages.0.model"),
    ],
)
def test_bad_stage_values_name_the_key(stage, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_pipeline_config({"stages": [stage]})


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    from omnistage.pipelines import parse_pipeline

    with pytest.raises(ConfigError, match=r"stages\.0\.kind: unknown stage kind 'gan'.*'ar'"):
        parse_pipeline({"stages": [{**AR, "kind": "gan"}]}, "test")


def test_stage_ids_must_be_in_order():
    with pytest.raises(ConfigError, match="stage_id values must be 0..1"):
        parse_pipeline_config({"stages": [AR, {**AR, "stage_id": 5}]})


def test_input_must_come_from_an_earlier_stage():
    with pytest.raises(ConfigError, match="input_from"):
        parse_pipeline_config({"stages": [{**AR, "input_from": 0, "input_processor": "x"}]})


def test_config_is_frozen():
    config = parse_pipeline_config({"stages": [AR]})
    with pytest.raises(ValueError):
        config.stages[0].max_num_seqs = 3  # type: ignore[misc]


def test_unreadable_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("stages: [")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_pipeline_config(path)


def test_idle_sleep_needs_sleep_mode():
    with pytest.raises(ConfigError, match="idle_sleep_s needs enable_sleep_mode"):
        parse_pipeline_config({"stages": [{**AR, "idle_sleep_s": 5}]})
