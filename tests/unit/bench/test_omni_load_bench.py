"""``omnistage bench omni_load``: its rows from measured runs (no processes here), the
code2wav-threads variant's pipeline file, and the bench-size preset it loads."""

from __future__ import annotations

from typing import Any

from omnistage.bench import omni_load
from omnistage.config import load_pipeline_config
from omnistage.models.qwen2_5_omni.tiny_specs import BENCH
from omnistage.models.tiny import PRESETS
from omnistage.pipelines import builtin_pipelines, load_pipeline


def _run(rate: float, audio: list[bytes], ttfa: float | None, e2e: float) -> dict[str, Any]:
    return {
        "summary": {"request_throughput": rate, "duration": len(audio) / rate},
        "audio": audio,
        "ttfa_ms": ttfa,
        "e2e_ms": e2e,
        "cpu": {"thinker": 0.1, "talker": 0.5, "code2wav": 1.4},
        "batched_steps": "3/10",
    }


def test_rows_compare_with_concurrency_1_the_whole_audio_and_transformers():
    runs = {
        ("streamed", 1): _run(0.5, [b"a", b"b"], 100.0, 2000.0),
        ("streamed", 8): _run(1.0, [b"a", b"x", b"c", b"d"], 300.0, 8000.0),
        ("whole", 1): _run(0.4, [b"A", b"B"], 2500.0, 2500.0),
    }
    rows = {(r["variant"], r["concurrency"]): r for r in omni_load.rows("p", runs, 0.25)}
    alone, loaded, whole = rows["streamed", 1], rows["streamed", 8], rows["whole", 1]
    assert loaded["vs_concurrency_1"] == 2.0 and loaded["vs_transformers"] == 4.0
    assert alone["ttfa_vs_whole"] == 100.0 / 2500.0
    assert loaded["ttfa_vs_whole"] is None  # no whole run at 8
    assert loaded["audio_as_alone"] == "1/2" and whole["audio_as_alone"] == "2/2"
    assert alone["cpu_busy"] == 2.0 * 2 / 4.0  # 2 CPU-s per request x 2 requests / 4 s
    assert set(omni_load.COLUMNS) == set(alone)


def test_a_variant_sets_only_the_code2wav_stage(tmp_path):
    args = omni_load.pipeline_args("tiny-qwen2.5-omni", {"torch_threads": 2}, tmp_path)
    assert args[0] == "--config"
    config = load_pipeline_config(args[1])
    assert [s.torch_threads for s in config.stages] == [None, None, 2]
    assert all("{cache}" not in s.model for s in config.stages)  # the model cache's folder
    args = omni_load.pipeline_args("tiny-qwen2.5-omni", {"step_threads": 1}, tmp_path)
    assert [s.step_threads for s in load_pipeline_config(args[1]).stages] == [1, 1, 1]
    assert omni_load.pipeline_args("tiny-qwen2.5-omni", {}, tmp_path) == [
        "--pipeline",
        "tiny-qwen2.5-omni",
    ]


def test_the_bench_size_preset_is_built_in_and_shaped_like_the_real_model():
    assert "bench-qwen2.5-omni" in builtin_pipelines() and "bench-qwen2.5-omni" in PRESETS
    config = load_pipeline("bench-qwen2.5-omni", build=False)
    assert [s.model_stage for s in config.stages] == ["thinker", "talker", "code2wav"]
    assert all(s.preset == "bench-qwen2.5-omni" for s in config.stages)
    assert BENCH.samples_per_code == 480  # 50 codes per second of 24 kHz audio, as the real one
    assert sum(BENCH.mrope_section) == BENCH.hidden_size // BENCH.num_heads // 2
    assert sum(BENCH.talker_mrope_section) == BENCH.talker_head_dim // 2
