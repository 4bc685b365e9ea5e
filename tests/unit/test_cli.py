"""The ``omnistage serve`` command line: every sizing flag reaches the stage configs, vLLM's
spellings work, flags omnistage lacks are named, and ``--help`` is readable."""

from __future__ import annotations

import operator
import subprocess
import sys

import pytest

from omnistage.cli import build_parser, main
from omnistage.entrypoints.cli_args import serve_values
from omnistage.entrypoints.openai.api_server import ready_banner
from omnistage.entrypoints.openai.server_config import ServerConfig


def stages_of(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig.model_validate(serve_values(args)).pipeline_config().stages


@pytest.mark.parametrize(
    ("argv", "field", "expected"),
    [
        (["--max-model-len", "300"], "ar.max_model_len", 300),
        (["--max-num-seqs", "7"], "ar.max_num_seqs", 7),
        (["--max-num-batched-tokens", "999"], "ar.max_num_batched_tokens", 999),
        (["--dtype", "half"], "dtype", "float16"),
        (["--dtype", "bfloat16"], "dtype", "bfloat16"),
        (["--dtype", "auto"], "dtype", "auto"),
        (["--dtype", "float"], "dtype", "float32"),
        (["--kv-cache-memory", "12345678"], "ar.kv_cache_memory", 12345678),
        (["--kv-cache-memory", "64MiB"], "ar.kv_cache_memory", 64 << 20),
        (["--kv-cache-memory-bytes", "2GB"], "ar.kv_cache_memory", 2 * 10**9),
        (["--no-enable-prefix-caching"], "ar.enable_prefix_caching", False),
        (["--enable-prefix-caching"], "ar.enable_prefix_caching", True),
        (
            ["--device", "cuda:1", "--gpu-memory-utilization", "0.5"],
            "ar.gpu_memory_utilization",
            0.5,
        ),
        (["--enable-sleep-mode", "--idle-sleep-s", "9"], "idle_sleep_s", 9.0),
    ],
)
def test_each_flag_reaches_every_stage_config(argv, field, expected):
    stages = stages_of("--pipeline", "tiny-chat", *argv)
    assert [operator.attrgetter(field)(s) for s in stages] == [expected] * len(stages)


def test_a_kv_sizing_flag_replaces_the_pipelines_own():
    # tiny-chat sets kv_cache_memory; --gpu-memory-utilization takes its place, not beside it
    (stage,) = stages_of(
        "--pipeline", "tiny-chat", "--device", "cuda", "--gpu-memory-utilization", "0.8"
    )
    assert stage.ar.kv_cache_memory is None and stage.ar.gpu_memory_utilization == 0.8


def test_flags_reach_a_yaml_pipeline_given_by_vllm_omnis_flag_name(tmp_path):
    from omnistage.pipelines import cache_dir

    config = tmp_path / "p.yaml"
    config.write_text(
        "name: mine\nstages:\n"
        f"  - {{stage_id: 0, kind: ar, model: '{cache_dir()}/demo', preset: demo,"
        " kv_cache_memory: 32MiB, dtype: half}\n"
    )
    (stage,) = stages_of("--stage-configs-path", str(config), "--max-num-seqs", "3")
    assert (stage.ar.max_num_seqs, stage.ar.kv_cache_memory, stage.dtype) == (
        3,
        32 << 20,
        "float16",
    )


def test_the_positional_model_is_the_model(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (stage,) = stages_of(str(tmp_path), "--max-model-len", "64")
    assert stage.model == str(tmp_path) and stage.ar.max_model_len == 64
    with pytest.raises(SystemExit, match="differ"):
        stages_of(str(tmp_path), "--model", str(tmp_path / "other"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-memory-utilization", "0.9"], "applies to CUDA stages"),
        (["--gpu-memory-utilization", "1.5"], "less than or equal to 1"),
        (["--kv-cache-memory", "lots"], "byte count"),
        (["--dtype", "int8"], "dtype"),
        (["--max-model-len", "0"], "greater than 0"),
    ],
)
def test_bad_sizing_values_fail_naming_the_setting(argv, message):
    with pytest.raises(Exception, match=message):
        stages_of("--pipeline", "tiny-chat", *argv)


def test_a_vllm_flag_omnistage_lacks_is_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--pipeline", "tiny-chat", "--pipeline-parallel-size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--pipeline-parallel-size is a vLLM flag omnistage does not support" in err
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_help_shows_each_default_once():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    options = text.split("options:")[1].split("\n  -")
    assert all(option.count("default") <= 1 for option in options), [
        o for o in options if o.count("default") > 1
    ]
    assert "(default: None)" not in text and "(default: 8000)" in text


def test_the_api_key_comes_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--pipeline", "tiny-chat"])
    assert serve_values(args)["api_key"] == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "from-flag"])
    assert serve_values(args)["api_key"] == "from-flag"


def test_the_banner_never_prints_a_key(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_CONTROL_API_KEY", "control-secret")
    banner = ready_banner(ServerConfig(api_key="data-secret"), 8000)
    assert "secret" not in banner
    assert "$OMNISTAGE_API_KEY" in banner and "$OMNISTAGE_CONTROL_API_KEY" in banner


class _Pipeline:
    """What the banner asks of an engine: its outputs, and whether a video request passes."""

    def __init__(self, outputs: list[str], videos: bool = False) -> None:
        self.outputs, self.videos = outputs, videos

    def output_modalities(self) -> list[str]:
        return self.outputs

    def check(self, prompt, sampling_params, modalities, image_params=None) -> None:
        if not self.videos:
            raise ValueError("this pipeline makes images, not videos")


@pytest.mark.parametrize(
    ("outputs", "videos", "present", "absent"),
    [
        (["text"], False, ["chat/completions"], ["audio", "images/generations", "videos"]),
        (["text", "audio"], False, ['"modalities": ["text", "audio"]', "hello.wav"], ["videos"]),
        (["text", "image"], False, ["chat/completions"], ["images/generations"]),
        (["image"], False, ["images/generations"], ["chat/completions", "videos"]),
        (["image"], True, ["videos/sync", "cat.mp4"], ["chat/completions"]),
    ],
)
def test_the_banner_suggests_what_the_pipeline_answers(outputs, videos, present, absent):
    """A chat curl on an image or video pipeline was a 400; a speech pipeline had no speech
    example (each printed line was run by hand against tiny-qwen2.5-omni, tiny-wan and
    tiny-flux)."""
    banner = ready_banner(ServerConfig(), 8000, _Pipeline(outputs, videos))
    assert all(p in banner for p in present), banner
    assert not any(a in banner for a in absent), banner


@pytest.mark.parametrize("module", ["omnistage", "omnistage.entrypoints.openai.api_server"])
def test_module_entry_points_take_the_cli(module):
    """``python -m omnistage`` is the CLI; vLLM-Omni's ``python -m ...api_server`` is
    ``omnistage serve`` (its help lists serve's flags)."""
    argv = ["serve", "--help"] if module == "omnistage" else ["--help"]
    out = subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--enable-sleep-mode" in out.stdout and "--max-model-len" in out.stdout
