"""Writing benchmark results: one JSON file and a Markdown table per benchmark, each table
followed by a legend of its columns (``omnistage.bench.legend``)."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omnistage.bench.legend import legend


def environment() -> dict[str, Any]:
    import torch  # here, not at the top: `omnistage bench serve` needs no torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def markdown_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    extra_legend: Mapping[str, str] | None = None,
) -> str:
    """The table, a blank line, then the legend of its columns (and ``extra_legend``)."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + legend(columns, extra_legend)


def write_results(
    out_dir: str | Path, name: str, rows: list[dict[str, Any]], columns: Sequence[str]
) -> str:
    """Write ``<out_dir>/<name>.json`` and ``<name>.md``; return the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, columns)
    (out / f"{name}.json").write_text(json.dumps({"env": environment(), "rows": rows}, indent=2))
    (out / f"{name}.md").write_text(table + "\n")
    return table
