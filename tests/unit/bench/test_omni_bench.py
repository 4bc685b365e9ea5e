"""The Qwen2.5-Omni benchmark: its comparisons and summaries on made-up outputs, the command
line, and one real run with tiny settings (two prompts, 4 thinker tokens, 8 speech codes, 2
ODE steps, one sleep cycle per stage and level, 1 s clips, one audio length and one image size
for the encoders, one cache hit per medium; stages as threads instead of processes)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from omnistage import cli
from omnistage.bench import omni as bench
from omnistage.bench import omni_media as media


def speech(prompt: str = "hi", codes: tuple[int, ...] = (1, 2), wave: Any = (0.5, -0.25)):
    return bench.Speech(prompt, [7, 8], list(codes), np.asarray(wave, dtype=np.float32), 4)


def test_compare_counts_agreement_and_measures_the_difference_against_the_peak():
    alone = [speech("a"), speech("b")]
    same = bench.compare("x2", alone, [speech("a"), speech("b")])
    assert same["same_codes"] == "2/2" and same["max_abs_diff_over_peak"] == 0.0
    other = [speech("a", codes=(1, 3), wave=(0.5, -0.3)), speech("b", wave=(0.5, -0.25, 0.0))]
    row = bench.compare("transformers", alone, other)
    assert row["same_thinker_ids"] == "2/2" and row["same_codes"] == "1/2"
    assert row["same_length"] == "1/2"  # the other length is left out of the difference
    assert row["max_abs_diff_over_peak"] == pytest.approx(0.05 / 0.5)
    assert bench.compare("none", alone[:1], other[1:])["max_abs_diff_over_peak"] is None
    assert set(bench.AUDIO_COLUMNS) <= set(row)


def test_identical_means_ids_codes_and_every_sample():
    assert bench.identical(speech(), speech())
    assert not bench.identical(speech(), speech(wave=(0.5, -0.2500001)))
    assert not bench.identical(speech(), speech(codes=(1,)))


def test_rows_are_ratios_against_the_baseline_and_medians():
    run = bench.Timed(2.0, [speech(), speech()], {"thinker": [0.1, 0.3], "talker": [0.5]})
    row = bench.throughput_row("omnistage", 8, run, baseline_s=3.0)
    assert row["audio_s"] == pytest.approx(1.0) and row["rtf"] == pytest.approx(2.0)
    assert row["requests_per_s"] == 1.0 and row["speedup_vs_transformers"] == 1.5
    assert row["thinker_ms"] == pytest.approx(200) and row["code2wav_ms"] is None
    cycles = [dict.fromkeys(bench.SLEEP_TIMED, v) | {"same_audio": v != 3} for v in (1, 3, 2)]
    sleep = bench.sleep_row("1 (talker)", 2, cycles)
    assert sleep["wake_ms"] == 2 and sleep["same_audio"] is False
    bench.add_cold_start(sleep, 400.0)
    assert sleep["wake_speedup_vs_cold_start"] == 100.0
    assert set(bench.SLEEP_COLUMNS) <= set(sleep)


def test_audio_in_rows_count_agreement_with_transformers_per_request():
    theirs = bench.Timed(4.0, [speech("audio 0"), speech("audio 1")], {"processor": [0.2, 0.4]})
    ours = bench.Timed(2.0, [speech("audio 0"), speech("audio 1", codes=(9,))])
    rows = media.throughput_rows(bench.throughput_row, theirs, {1: ours, 8: ours})
    assert [(r["engine"], r["concurrency"]) for r in rows] == [
        ("transformers", 1),
        ("omnistage", 1),
        ("omnistage", 8),
    ]
    assert rows[0]["processor_ms"] == pytest.approx(300) and "same_codes" not in rows[0]
    assert rows[1]["speedup_vs_transformers"] == 2.0 and rows[1]["processor_ms"] is None
    assert rows[1]["same_thinker_ids"] == "2/2" and rows[1]["same_codes"] == "1/2"
    assert set(media.THROUGHPUT_COLUMNS) - {"same_thinker_ids", "same_codes"} <= set(rows[0])


def test_audio_requests_get_a_fresh_content_hash_per_pass(tmp_path):
    heard = media.AudioRequests(tmp_path, ("Hi", "Count"), media.MediaSettings(audio_s=0.5))
    assert heard.names == ("audio 0", "audio 1")
    first, again = heard.omnistage("x1")("audio 1"), heard.omnistage("x8")("audio 1")
    assert first["messages"][0]["content"] == [
        {"type": "audio"},
        {"type": "text", "text": "Count"},
    ]
    (a,), (b,) = first["multi_modal_data"], again["multi_modal_data"]
    assert a.content_hash != b.content_hash
    assert a.value.samples is b.value.samples and a.value.sampling_rate == 16000
    assert len(a.value.samples) == 8000 and a.value.samples.dtype == np.float32
    assert not np.array_equal(a.value.samples[:100], heard.clips["audio 0"][:100])
    with pytest.raises(ValueError, match="repeats"):
        media.MediaSettings(cache_repeats=0)


def test_a_failed_sleep_is_an_error_not_a_figure():
    with pytest.raises(bench.OmniBenchError, match="talker sleep"):
        bench._check("talker sleep level 1", [{"status": "ERROR"}])


def test_cli_runs_omni_alone_and_in_all(tmp_path, monkeypatch):
    import importlib

    called: list[str] = []
    names = list(cli.BENCHMARKS)
    assert "coldstart" in names and "omni" in names
    for name in names:
        module = importlib.import_module(f"omnistage.bench.{name}")
        monkeypatch.setattr(module, "run", lambda out, _n=name, **kw: called.append(_n) or "")
    assert cli.main(["bench", "omni", "--out", str(tmp_path)]) == 0
    assert called == ["omni"]
    assert cli.main(["bench", "all", "--out", str(tmp_path)]) == 0
    assert called[1:] == names


@pytest.mark.slow
def test_a_tiny_run_writes_the_six_tables(tmp_path):
    settings = bench.Settings(
        prompts=bench.PROMPTS[:2],
        thinker_tokens=4,
        talker_tokens=8,
        num_steps=2,
        concurrency=(1, 2),
        repeats=1,
        stream=False,  # servers of its own: omni_stream's rows are checked apart
        media=media.MediaSettings(
            audio_s=1.0,
            encoder_audio_s=(1.0,),
            encoder_images=((56, 84),),
            encoder_repeats=1,
            cache_image=(56, 56),
            cache_repeats=1,
        ),
    )
    tables = bench.run(
        str(tmp_path), settings=settings, in_process=True, pipelines=[bench.PIPELINE]
    )
    assert tables.count("| engine |") == 2 and "| 2 (code2wav) | 2 |" in tables

    def load(part: str) -> dict[str, Any]:
        return json.loads((tmp_path / f"omni-cpu-{part}.json").read_text())

    throughput = load("throughput")
    assert throughput["env"]["torch"]
    rows = throughput["rows"]
    assert [(r["engine"], r["concurrency"]) for r in rows] == [
        ("transformers", 1),
        ("omnistage", 1),
        ("omnistage", 2),
    ]
    assert all(r["requests"] == 2 and r["audio_s"] > 0 and r["rtf"] > 0 for r in rows)
    assert all(r[f"{stage}_ms"] > 0 for r in rows for stage in ("thinker", "talker", "code2wav"))
    batch, shipped, restored = load("audio")["rows"]
    assert batch["same_codes"] == "2/2" and batch["max_abs_diff_over_peak"] == 0.0
    assert shipped["same_thinker_ids"] == "2/2"  # only the talker's prefill differs there
    assert restored["same_codes"] == "2/2" and restored["max_abs_diff_over_peak"] < 1e-3
    sleep = load("sleep")["rows"]
    assert [(r["stage"], r["level"]) for r in sleep] == [
        (f"{i} ({name})", level)
        for i, name in enumerate(["thinker", "talker", "code2wav"])
        for level in (1, 2)
    ]
    assert all(r["same_audio"] for r in sleep)
    assert all(r["freed_mib"] > 0 for r in sleep if r["level"] == 2)
    heard = load("media")["rows"]
    assert [(r["engine"], r["concurrency"]) for r in heard] == [
        (r["engine"], r["concurrency"]) for r in rows
    ]
    assert all(r["requests"] == 2 and r["audio_s"] > 0 for r in heard)
    assert heard[0]["processor_ms"] > 0  # transformers' processor, inside its requests
    assert all(r["same_thinker_ids"] == "2/2" and r["same_codes"] == "2/2" for r in heard[1:])
    audio, image = load("encoders")["rows"]
    assert (audio["medium"], audio["tokens"]) == ("audio 1 s", 25)
    assert (image["medium"], image["tokens"]) == ("image 84x56", 6)  # 56 x 84 px, 2 x 3 merged
    assert audio["encoder_ms_per_audio_s"] == audio["encoder_ms"] > 0
    assert all(r["same_as_transformers"] and r["transformers_ms"] > 0 for r in (audio, image))
    cache = load("encoder-cache")["rows"]
    assert [r["medium"] for r in cache] == ["image 56x56", "audio 1 s"]
    assert all(r["encoder_queries"] == 2 and r["encoder_hits"] == 1 for r in cache)
    assert all(r["miss_ms"] > 0 and r["hit_ms"] > 0 for r in cache)


def test_streamed_rows_compare_modes_concurrency_and_audio():
    from omnistage.bench import omni_stream

    def run(rate: float, ttfa: float, e2e: float, audio: list[bytes]) -> dict[str, Any]:
        summary = {"request_throughput": rate}
        return {"summary": summary, "audio": audio, "ttfa_ms": ttfa, "e2e_ms": e2e}

    runs = {
        ("streamed", 1): run(1.0, 100.0, 1000.0, [b"a", b"b"]),
        ("streamed", 8): run(2.0, 300.0, 4000.0, [b"a", b"x", b"a", b"b"]),
        ("whole", 1): run(1.2, 800.0, 800.0, [b"c", b"d"]),
        ("whole", 8): run(1.5, 5000.0, 5000.0, [b"c", b"d", b"c", b"d"]),
    }
    rows = {(r["mode"], r["concurrency"]): r for r in omni_stream.rows(runs, 0.5)}
    streamed = rows["streamed", 8]
    assert (streamed["vs_concurrency_1"], streamed["vs_transformers"]) == (2.0, 4.0)
    assert streamed["ttfa_vs_whole"] == 300.0 / 5000.0 and streamed["audio_as_alone"] == "1/2"
    assert rows["streamed", 1]["ttfa_vs_whole"] == 100.0 / 800.0
    assert rows["whole", 8]["audio_as_alone"] == "2/2"
