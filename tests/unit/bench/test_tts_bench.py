"""``omnistage bench tts``: its rows from measured requests (no processes here), the bodies it
sends, and the bench-size preset and pipeline it serves."""

from __future__ import annotations

import numpy as np

from omnistage.bench import tts
from omnistage.models.tiny import PRESETS
from omnistage.pipelines import builtin_pipelines


def _result(ttfa: float, e2e: float, samples: list[int]) -> dict:
    return {"ttfa": ttfa, "e2e": e2e, "pcm": np.array(samples, dtype="<i2")}


def test_a_row_compares_with_the_package_one_call_at_a_time_and_batched():
    package = [_result(2.0, 2.0, [0, 10, 20, 30]), _result(2.0, 2.0, [5, 5])]
    reference = {1: (package, 4.0), 2: (package, 1.0)}
    ours = [_result(0.5, 1.0, [0, 11, 20, 30]), _result(0.2, 1.0, [5, 7])]
    row = tts._row("p", "omnistage", 2, ours, 2.0, reference)
    assert row["requests_per_s"] == 1.0
    assert row["vs_reference_1"] == 2.0  # the package one at a time: 2 requests in 4 s
    assert row["vs_reference_batch"] == 0.5  # its batched call: 2 in 1 s
    assert row["as_package"] == "1/2"  # within one 16-bit step; the second is two off
    assert row["ttfa_vs_e2e"] == 0.35 and row["speech_s"] == 3 / tts.RATE


def test_a_long_row_says_whether_its_speech_is_the_whole_answers():
    whole = [_result(3.0, 3.0, [1, 2, 3])]
    early = [_result(0.3, 3.0, [9, 2, 3])]
    row = tts._long_row("p", "early chunk", early, 3.0, whole)
    assert row["engine"] == "omnistage early chunk" and row["as_package"] == "0/1 as whole"
    assert round(row["ttfa_vs_e2e"], 6) == 0.1


def test_the_bodies_ask_greedy_streamed_pcm_within_the_bound():
    body = tts._body(3, max_new_tokens=tts.LONG_FRAMES)
    assert body["input"] == tts.TEXTS[3] and body["voice"] == tts.SPEAKERS[3]
    assert (body["temperature"], body["stream_format"], body["response_format"]) == (
        0, "audio", "pcm",
    )  # fmt: skip
    assert body["max_new_tokens"] == tts.LONG_FRAMES and len(tts.TEXTS) == len(tts.SPEAKERS)


def test_its_presets_are_built_in_pipelines():
    for preset in tts.PIPELINES:
        assert preset in PRESETS and preset in builtin_pipelines()
