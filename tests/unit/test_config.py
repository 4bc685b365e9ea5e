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
        ({**AR, "max_num_seqs": 0}, "stages.0.ar.max_num_seqs"),
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
        config.stages[0].ar.max_num_seqs = 3  # type: ignore[misc]


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


# -- a stage config by kind: what every stage has, and each kind's own options ---------------


def test_a_kinds_options_nest_under_its_kind_and_the_flat_shape_still_loads():
    flat = {**AR, "max_model_len": 64, "kv_cache_memory": "1MiB", "max_num_seqs": 3}
    nested = {**AR, "ar": {"max_model_len": 64, "kv_cache_memory": "1MiB", "max_num_seqs": 3}}
    old_name = {**AR, "max_model_len": 64, "kv_cache_bytes": 1 << 20, "max_num_seqs": 3}
    configs = [parse_pipeline_config({"stages": [s]}).stages[0] for s in (flat, nested, old_name)]
    assert configs[0] == configs[1] == configs[2]
    assert (configs[0].ar.max_model_len, configs[0].ar.kv_cache_memory) == (64, 1 << 20)
    code2wav = {**AR, "kind": "code2wav", "max_num_seqs": 2}
    assert parse_pipeline_config({"stages": [code2wav]}).stages[0].code2wav.max_num_seqs == 2


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        # an option of another kind names where it belongs
        ({**AR, "max_batch_size": 2}, r"max_batch_size: an option of 'diffusion' stages "
         r"\(diffusion\.max_batch_size\); a 'ar' stage does not take it"),
        ({**AR, "kind": "diffusion", "max_model_len": 8}, r"\(ar\.max_model_len\)"),
        ({**AR, "diffusion": {"max_batch_size": 2}}, "diffusion: a 'ar' stage takes no"),
        ({**AR, "ar": {"max_batch_size": 2}}, r"stages\.0\.ar\.max_batch_size: unknown key"),
        ({**AR, "kv_cache_bytes": 1, "kv_cache_memory": 1}, "the same setting"),
        ({**AR, "max_model_len": 8, "ar": {"max_model_len": 9}}, r"ar\.max_model_len is given twice"),
        ({**AR, "ar": {"gpu_memory_utilization": 0.5}}, "applies to CUDA stages"),
        ({**AR, "device": "cuda", "ar": {"gpu_memory_utilization": 0.5, "kv_cache_memory": 9}},
         "gpu_memory_utilization or kv_cache_memory, not both"),
    ],
)  # fmt: skip
def test_options_in_the_wrong_place_are_refused_naming_the_key(stage, message):
    with pytest.raises(ConfigError, match=message):
        parse_pipeline_config({"stages": [stage]})


def test_the_built_in_pipelines_use_the_shape_by_kind():
    from importlib import resources

    import yaml

    from omnistage.config import KIND_OPTIONS, option_kinds
    from omnistage.pipelines import builtin_pipelines

    for name in builtin_pipelines():
        text = resources.files("omnistage.pipelines").joinpath(f"{name}.yaml").read_text()
        for stage in yaml.safe_load(text)["stages"]:
            flat = [key for key in stage if key not in KIND_OPTIONS and option_kinds(key)]
            assert not flat, (name, flat)


def test_a_setting_for_every_stage_reaches_the_stages_that_take_it():
    from omnistage.pipelines import load_pipeline

    config = load_pipeline(
        "tiny-omni", build=False, max_num_seqs=5, max_batch_size=3, kv_cache_bytes=1 << 22
    )
    ar, diffusion = config.stages
    assert (ar.ar.max_num_seqs, ar.ar.kv_cache_memory, ar.diffusion.max_batch_size) == (
        5, 1 << 22, 4,
    )  # fmt: skip
    assert diffusion.diffusion.max_batch_size == 3 and diffusion.ar == type(diffusion.ar)()
    with pytest.raises(TypeError, match="the same setting"):
        load_pipeline("tiny-omni", build=False, kv_cache_bytes=1, kv_cache_memory=1)
    with pytest.raises(ConfigError, match="unknown pipeline overrides"):
        load_pipeline("tiny-omni", build=False, max_batch_sizes=3)
