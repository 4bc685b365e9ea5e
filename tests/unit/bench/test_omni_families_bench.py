"""``bench omni``'s families table (Qwen3-Omni beside Qwen2.5-Omni): its rows on made-up
passes, the pipelines it takes, and the command line handing them over."""

from __future__ import annotations

import pytest

from omnistage import cli
from omnistage.bench import omni_families as families


def heard(prompt: str, codes=(1, 2), audio_s=0.5, ttfa_s=0.1, e2e_s=0.4):
    return families.Heard(prompt, list(codes), audio_s, ttfa_s, e2e_s)


def test_a_row_is_ratios_against_transformers_in_the_same_run():
    theirs = families.Pass(4.0, [heard("a", ttfa_s=1.0), heard("b", ttfa_s=3.0)])
    ours = families.Pass(1.0, [heard("a", ttfa_s=0.1), heard("b", codes=(9,), ttfa_s=0.3)])
    family = families.FAMILIES[families.QWEN3]
    row = families.row(family, "omnistage", 8, ours, theirs, theirs)
    assert (row["model"], row["engine"], row["concurrency"]) == ("Qwen3-Omni", "omnistage", 8)
    assert row["audio_s"] == 1.0 and row["rtf"] == 1.0 and row["requests_per_s"] == 2.0
    assert row["ttfa_ms"] == pytest.approx(200) and row["e2e_ms"] == pytest.approx(400)
    assert row["speedup_vs_transformers"] == 4.0
    assert row["ttfa_vs_transformers"] == pytest.approx(0.1)
    assert row["same_codes"] == "1/2"
    assert set(families.COLUMNS) == set(row)
    baseline = families.row(family, "transformers", 1, theirs, theirs, theirs)
    assert baseline["speedup_vs_transformers"] == 1.0 and baseline["same_codes"] == "2/2"


def test_it_measures_the_two_omni_pipelines_only():
    assert families.check_pipelines([families.QWEN3, families.QWEN3]) == (families.QWEN3,)
    with pytest.raises(ValueError, match="tiny-chat"):
        families.check_pipelines(["tiny-chat"])
    with pytest.raises(ValueError, match="--pipelines"):
        families.check_pipelines([])


def test_the_command_line_hands_the_pipelines_over(tmp_path, monkeypatch):
    from omnistage.bench import omni

    seen: list[dict] = []
    monkeypatch.setattr(omni, "run", lambda out, **kw: seen.append(kw) or "")
    argv = ["bench", "omni", "--out", str(tmp_path)]
    assert cli.main(argv) == 0 and "pipelines" not in seen[0]  # run's default: both
    assert cli.main([*argv, "--pipelines", "tiny-qwen3-omni"]) == 0
    assert seen[1]["pipelines"] == ("tiny-qwen3-omni",)
