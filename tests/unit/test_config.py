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


def test_the_speech_pipelines_stream_and_no_stream_hands_every_output_over_whole():
    from omnistage.pipelines import load_pipeline

    streamed = load_pipeline("tiny-qwen2.5-omni", build=False)
    assert [s.stream for s in streamed.stages] == [False, True, True]
    whole = load_pipeline("tiny-qwen2.5-omni", build=False, stream=False)
    assert not any(s.stream for s in whole.stages)


def test_stream_needs_an_input_and_a_kind_that_takes_it():
    from omnistage.stage.kinds import check_kinds

    stage = {"kind": "ar", "model": "m"}
    with pytest.raises(ValueError, match="stream needs input_from"):
        parse_pipeline_config({"stages": [{"stage_id": 0, **stage, "stream": True}]})
    image = {"kind": "diffusion", "model": "m"}
    config = parse_pipeline_config(
        {
            "stages": [
                {"stage_id": 0, **stage},
                {"stage_id": 1, **image, "input_from": 0, "input_processor": "x", "stream": True},
            ]
        }
    )
    with pytest.raises(
        ConfigError, match=r"stages.1.stream: a 'diffusion' stage takes its input whole"
    ):
        check_kinds(config)


def test_a_pipeline_files_relative_models_never_resolve_against_the_working_directory(
    tmp_path, monkeypatch
):
    """Serving examples/pipeline.yaml built models/ into whatever folder it was run from."""
    from omnistage.pipelines import cache_dir, pipeline_from_file

    folder, elsewhere = tmp_path / "conf", tmp_path / "cwd"
    (folder / "ckpt").mkdir(parents=True)
    elsewhere.mkdir()
    (folder / "p.yaml").write_text(
        "stages:\n"
        "  - {stage_id: 0, kind: ar, model: ckpt}\n"  # beside the file: taken from there
        "  - {stage_id: 1, kind: ar, model: models/demo, preset: demo, input_from: 0,"
        " input_processor: thinker_hidden_to_image_cond}\n"
    )
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path / "cache"))
    first, second = pipeline_from_file(folder / "p.yaml").stages
    assert first.model == str(folder / "ckpt")
    assert second.model == str(cache_dir() / "models" / "demo")  # a preset: the model cache
    assert not (elsewhere / "models").exists()
