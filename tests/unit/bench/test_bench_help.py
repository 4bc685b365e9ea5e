"""Every ``omnistage bench`` subcommand says what it measures and how long it takes, and every
table a benchmark prints carries a legend of its columns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from omnistage import bench, cli
from omnistage.bench import commands
from omnistage.bench.legend import UNDESCRIBED, describe
from omnistage.bench.report import markdown_table
from omnistage.bench.serve_stats import latency_columns


def bench_parsers() -> dict:
    (sub,) = [a for a in cli.build_parser()._subparsers._group_actions]  # type: ignore[union-attr]
    (names,) = sub.choices["bench"]._subparsers._group_actions  # type: ignore[union-attr]
    return dict(names.choices)


def test_every_bench_subcommand_says_what_it_measures_and_how_long_it_takes():
    parsers = bench_parsers()
    assert set(parsers) == {*commands.BENCHMARKS, "all", "serve"}
    for name, parser in parsers.items():
        text = " ".join(parser.format_help().split())
        assert "Measures " in text and " Takes " in text, name
        assert "2 CPU cores" in text, name


def table_columns() -> dict[str, list[str]]:
    """The column names in every ``*COLUMNS`` assignment of every module in omnistage.bench
    (read from the source: importing them all costs seconds), and bench serve's latency
    columns."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(bench.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and target.id.endswith("COLUMNS"):
                    names = [
                        n.value
                        for n in ast.walk(value)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    ]
                    found.setdefault(f"{path.stem}.{target.id}", []).extend(names)
    found["serve_stats.latency_columns"] = latency_columns((50, 90, 99.9))
    return found


@pytest.mark.parametrize(("table", "columns"), sorted(table_columns().items()))
def test_every_column_of_every_table_is_described(table, columns):
    missing = [c for c in columns if describe(c) == UNDESCRIBED]
    assert not missing, f"{table}: describe {missing} in omnistage/bench/legend.py"


def test_a_table_ends_with_its_legend():
    text = markdown_table([{"preset": "demo", "speedup": 1.5}], ["preset", "speedup"], {"x": "y"})
    table, legend = text.split("\n\n")
    assert table.splitlines()[2] == "| demo | 1.5 |"
    assert legend.splitlines() == [
        "Legend:",
        f"- `preset`: {describe('preset')}",
        f"- `speedup`: {describe('speedup')}",
        "- `x`: y",
    ]
    assert describe("no_such_column") == UNDESCRIBED  # a placeholder, never an error
