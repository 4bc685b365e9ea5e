"""The control benchmark's cycle and summary logic against a fake ``AsyncOmni``: the sleep
and wake ACKs are shaped as the stage sends them, including a CUDA wake's
``cuda_graph_recalled`` (which no run on this machine can produce)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from omnistage import cli
from omnistage.bench import control

REFERENCE = list(range(100, 116))


class FakeEngine:
    def __init__(self, *, recalled: bool = True, outputs: list[list[int]] | None = None) -> None:
        self.recalled = recalled
        self.outputs = outputs or []  # decodes after wakes; REFERENCE when exhausted
        self.calls: list[str] = []
        self.wake_status = "SUCCESS"

    async def sleep(self, stage_ids: list[int], level: int) -> list[dict[str, Any]]:
        self.calls.append(f"sleep{level}")
        return [{"status": "SUCCESS", "freed_bytes": level * 2**20, "metadata": {}}]

    async def wake_up(self, stage_ids: list[int]) -> list[dict[str, Any]]:
        self.calls.append("wake")
        meta = {"cuda_graph_recalled": self.recalled}
        return [{"status": self.wake_status, "freed_bytes": 0, "metadata": meta}]

    async def resume_generation(self, stage_ids: list[int]) -> None:
        self.calls.append("resume")

    async def generate(
        self, prompt: str, params: dict[str, Any], modalities: list[str]
    ) -> AsyncIterator[SimpleNamespace]:
        self.calls.append(f"generate{params['max_tokens']}")
        ids = self.outputs.pop(0) if params is control.DECODE and self.outputs else REFERENCE
        for token in ids[: params["max_tokens"]]:
            yield SimpleNamespace(new_token_ids=[token])


async def test_cycle_reports_the_wake_ack_and_compares_the_decode():
    engine = FakeEngine()
    cycle = await control._cycle(engine, 2, REFERENCE)  # type: ignore[arg-type]
    assert engine.calls == ["sleep2", "wake", "resume", "generate1", "generate16"]
    assert cycle["cuda_graph_recalled"] is True and cycle["same_output"] is True
    assert cycle["freed_mib"] == 2 and cycle["sleep_ms"] >= 0 and cycle["wake_ms"] >= 0

    changed = FakeEngine(recalled=False, outputs=[[7] * 16])
    cycle = await control._cycle(changed, 1, REFERENCE)  # type: ignore[arg-type]
    assert cycle["cuda_graph_recalled"] is False and cycle["same_output"] is False


async def test_a_failed_wake_is_an_error_not_a_figure():
    engine = FakeEngine()
    engine.wake_status = "ERROR"
    with pytest.raises(control.ControlBenchError, match="wake"):
        await control._cycle(engine, 1, REFERENCE)  # type: ignore[arg-type]


def test_summary_takes_medians_and_flags_only_when_every_cycle_held():
    cycles = [
        {"sleep_ms": s, "wake_ms": 2.0, "first_token_after_wake_ms": 1.0, "freed_mib": 4.0,
         "restore_gbps": 8.0, "reload_gbps": 6.0 + s,
         "cuda_graph_recalled": True, "same_output": same, "decode_ids_after": [s]}
        for s, same in ((1.0, True), (3.0, False), (2.0, True))
    ]  # fmt: skip
    row = control.summarize("tiny-chat", 2, cycles)
    assert row["sleep_ms"] == 2.0 and row["cuda_graph_recalled"] is True
    assert row["first_sleep_ms"] == 1.0 and row["reload_gbps"] == 8.0
    assert row["same_output"] is False and row["decode_ids_after_mismatch"] == [3.0]
    control.add_cold_start(row, 300.0)
    assert row["wake_speedup_vs_cold_start"] == pytest.approx(100.0)
    control.add_read_baseline(
        row, {"read_gbps": 4.0, "read_threads_gbps": 10.0, "fresh_read_gbps": 8.0}
    )
    assert row["reload_vs_read"] == 2.0 and row["reload_vs_fresh_read"] == 1.0
    assert set(control.COLUMNS) <= set(row)


def test_wake_acks_throughputs_reach_the_cycle():
    engine = FakeEngine()
    original = engine.wake_up

    async def wake_up(stage_ids):
        acks = await original(stage_ids)
        acks[0]["metadata"].update(gbps=12.5, reload_gbps=6.25)
        return acks

    engine.wake_up = wake_up  # type: ignore[method-assign]
    import asyncio

    cycle = asyncio.run(control._cycle(engine, 2, REFERENCE))  # type: ignore[arg-type]
    assert cycle["restore_gbps"] == 12.5 and cycle["reload_gbps"] == 6.25


def test_read_baselines_read_real_files(tmp_path):
    from omnistage.bench.read_baseline import read_baselines

    files = []
    for i in range(2):
        path = tmp_path / f"shard{i}.safetensors"
        path.write_bytes(bytes(range(256)) * 8192 * (i + 1))  # 2 MiB and 4 MiB
        files.append(path)
    baseline = read_baselines(files, threads=2, repeats=1)
    assert baseline["read_mib"] == 6.0
    assert all(baseline[k] > 0 for k in ("read_gbps", "read_threads_gbps", "fresh_read_gbps"))


def test_cli_passes_pipelines_and_repeats_to_control(tmp_path, monkeypatch):
    seen: dict[str, Any] = {}

    def fake_run(out_dir: str, **kwargs: Any) -> str:
        seen.update(kwargs, out_dir=out_dir)
        return "table"

    monkeypatch.setattr(control, "run", fake_run)
    argv = ["bench", "control", "--out", str(tmp_path), "--device", "cuda:0"]
    assert cli.main([*argv, "--pipelines", "tiny-chat, bench", "--repeats", "2"]) == 0
    assert seen == {
        "out_dir": str(tmp_path),
        "device": "cuda:0",
        "pipelines": ("tiny-chat", "bench"),
        "repeats": 2,
    }
    with pytest.raises(SystemExit):
        cli.main([*argv, "--pipelines", ","])


def test_results_are_written_per_pipeline(tmp_path, monkeypatch):
    def fake_pipeline(name, device, repeats, cold_starts, on_rows):
        rows = [{"pipeline": name, "level": 1, "wake_ms": 1.0, "first_token_after_wake_ms": 1.0}]
        on_rows(rows)
        if name == "bench":
            raise RuntimeError("cut")
        control.add_cold_start(rows[0], 10.0)
        return rows

    monkeypatch.setattr(control, "bench_pipeline", fake_pipeline)
    with pytest.raises(RuntimeError, match="cut"):
        control.run(str(tmp_path), pipelines=("tiny-chat", "bench"), repeats=1)
    rows = json.loads((tmp_path / "control-cpu.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["tiny-chat", "bench"]
    assert rows[0]["cold_start_ms"] == 10.0 and "cold_start_ms" not in rows[1]


def test_coldstart_gets_its_own_pipelines_unless_given(tmp_path, monkeypatch):
    from omnistage.bench import coldstart

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(coldstart, "run", lambda out, **kw: seen.append(kw) or "")
    assert cli.main(["bench", "coldstart", "--out", str(tmp_path)]) == 0
    assert cli.main(["bench", "coldstart", "--out", str(tmp_path), "--pipelines", "bench"]) == 0
    assert seen == [{"device": "cpu"}, {"device": "cpu", "pipelines": ("bench",)}]


def test_import_breakdown_sums_self_times_by_top_level_package():
    from omnistage.bench.coldstart import import_breakdown

    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       100 |        150 |     torch._C",
            "import time:        50 |        200 |   torch",
            "import time:         7 |          7 | omnistage.stage.proc",
            "something else",
        ]
    )
    assert import_breakdown(stderr) == {"torch": 150, "omnistage": 7}


def test_tp_bench_runs_one_and_two_ranks(tmp_path):
    from omnistage.bench import tp

    table = tp.run(str(tmp_path), pipeline="tiny-chat", batch_sizes=(2,), new_tokens=4, repeats=1)
    rows = json.loads((tmp_path / "tp-cpu.json").read_text())["rows"]
    assert [(r["tp"], r["seqs"]) for r in rows] == [(1, 2), (2, 2)]
    assert rows[0]["vs_tp1"] == 1 and rows[1]["tokens_per_s"] > 0
    assert rows[1]["same_ids"] == 1.0  # greedy ids of both ranks' model equal one rank's
    assert "| tiny-chat |" in table
