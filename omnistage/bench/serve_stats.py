"""The numbers of an ``omnistage bench serve`` run: per-metric statistics over the requests,
throughput, failures, and the two tables (with their legends) that print them.

The JSON's flat keys follow ``vllm bench serve``'s result file where they mean the same
(``completed``, ``total_output_tokens``, ``request_throughput``, ``mean_ttft_ms``,
``p99_itl_ms``, ...), so runs against omnistage and vLLM compare key by key.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from omnistage.bench.report import markdown_table
from omnistage.bench.serve_client import RequestResult

METRICS = {
    "ttft": "time to first token: request sent to its first content delta",
    "tpot": "time per output token after the first: (last content delta - first) / "
    "(output tokens - 1)",
    "itl": "inter-token latency: the gap between two consecutive content deltas (all gaps "
    "of all requests)",
    "ttfa": "time to first audio: request sent to its first delta.audio chunk with data",
    "e2el": "end-to-end latency: request sent to the end of its stream",
}
TOTAL_COLUMNS = [
    "backend",
    "model",
    "requests",
    "failed",
    "request_rate",
    "max_concurrency",
    "duration_s",
    "requests_per_s",
    "input_tokens",
    "output_tokens",
    "output_tokens_per_s",
    "total_tokens_per_s",
]
AUDIO_COLUMNS = ["audio_out_s"]  # beside the totals when audio was asked for or received
MAX_ERRORS = 5  # distinct error messages kept (the first ones)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def samples(results: Sequence[RequestResult], metric: str) -> list[float]:
    """A metric's values in seconds over the successful requests (ITL: every gap)."""
    ok = [r for r in results if r.success]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    values = (
        {"ttft": r.ttft, "tpot": r.tpot, "ttfa": r.ttfa, "e2el": r.latency}[metric] for r in ok
    )
    return [v for v in values if v is not None]


def _name(q: float) -> str:
    return f"p{q:g}"


def latency_columns(percentiles: Sequence[float]) -> list[str]:
    """The latency table's columns (a row per metric)."""
    return ["metric", "n", "mean_ms", "median_ms", *(f"{_name(q)}_ms" for q in percentiles)]


def metric_stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    """``n``, ``mean_ms``, ``median_ms``, ``std_ms`` and ``p<q>_ms``; None without values."""
    stats: dict[str, Any] = {"n": len(values)}
    ms = [v * 1e3 for v in values]
    stats["mean_ms"] = statistics.fmean(ms) if ms else None
    stats["median_ms"] = statistics.median(ms) if ms else None
    stats["std_ms"] = statistics.pstdev(ms) if ms else None
    for q in percentiles:
        stats[f"{_name(q)}_ms"] = percentile(ms, q) if ms else None
    return stats


def token_source(results: Sequence[RequestResult]) -> str:
    """Where the output token counts come from: the server's ``usage`` or the stream."""
    ok = [r for r in results if r.success]
    reported = sum(r.completion_tokens is not None for r in ok)
    if reported == len(ok):
        return "usage"
    return "stream" if reported == 0 else "usage where reported, else stream"


def first_errors(results: Sequence[RequestResult], limit: int = MAX_ERRORS) -> list[str]:
    """The first ``limit`` distinct error messages, each with how many requests got it."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    return [f"{n} x {message}" for message, n in list(counts.items())[:limit]]


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    metrics: Sequence[str],
    percentiles: Sequence[float],
    audio_format: str = "wav",
) -> dict[str, Any]:
    """The run's numbers as flat keys (see the module docstring)."""
    ok = [r for r in results if r.success]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    output = sum(r.output_tokens for r in ok)
    audio = [s for r in ok if (s := r.audio_seconds(audio_format)) is not None]
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(prompt) if prompt else None,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (sum(prompt) + output) / duration_s,
        "output_tokens_from": token_source(results),
        "audio_out_s": sum(audio) if audio else None,
        "errors": first_errors(results),
    }
    for metric in metrics:
        stats = metric_stats(samples(results, metric), percentiles)
        summary[f"n_{metric}"] = stats.pop("n")
        for key, value in stats.items():
            summary[f"{key[:-3]}_{metric}_ms"] = value  # mean_ms -> mean_ttft_ms
    return summary


def tables(
    summary: dict[str, Any],
    run: dict[str, Any],
    metrics: Sequence[str],
    percentiles: Sequence[float],
) -> str:
    """The totals table, the latency table (a row per metric), and notes on tokens and
    failures. ``run``: backend, model, request_rate, max_concurrency."""
    total = {
        **run,
        "requests": summary["completed"] + summary["failed"],
        "failed": summary["failed"],
        "duration_s": summary["duration"],
        "requests_per_s": summary["request_throughput"],
        "input_tokens": summary["total_input_tokens"] or "-",
        "output_tokens": summary["total_output_tokens"],
        "output_tokens_per_s": summary["output_throughput"],
        "total_tokens_per_s": summary["total_token_throughput"],
        "audio_out_s": "-" if summary["audio_out_s"] is None else summary["audio_out_s"],
    }
    audio = "ttfa" in metrics or summary["audio_out_s"] is not None
    columns = TOTAL_COLUMNS + (AUDIO_COLUMNS if audio else [])
    stat_columns = latency_columns(percentiles)
    rows = []
    for metric in metrics:
        row = {"metric": metric, "n": summary[f"n_{metric}"]}
        for column in stat_columns[2:]:
            value = summary[f"{column[:-3]}_{metric}_ms"]
            row[column] = "-" if value is None else value
        rows.append(row)
    parts = [
        markdown_table([total], columns),
        markdown_table(rows, stat_columns, {m: METRICS[m] for m in metrics}),
    ]
    source = summary["output_tokens_from"]
    if source != "usage" and summary["completed"]:
        parts.append(
            f"Output tokens: counted from the stream ({source}): the server reported no usage, "
            "so each content delta counts as one token (a delta carrying several tokens "
            "undercounts; tpot and the token throughputs follow)."
        )
    if summary["total_input_tokens"] is None and summary["completed"]:
        parts.append("Input tokens: unknown (the server reported no usage).")
    if summary["errors"]:
        parts.append("First errors:\n" + "\n".join(f"- {e}" for e in summary["errors"]))
    return "\n\n".join(parts)
