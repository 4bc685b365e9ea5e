"""``omnistage ctl``: the control plane over HTTP, with readable tables."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from omnistage.stage.vocabulary import (
    DEFAULT_SLEEP_LEVEL,
    DEFAULT_SLEEP_MODE,
    KNOWN_TAGS,
    SLEEP_LEVELS,
    SLEEP_MODES,
)


def _connection_flags(p: argparse.ArgumentParser, suppress: bool) -> None:
    """--url, --api-key and --json; on each subcommand too (``suppress``: no default there,
    so ``ctl --url U status`` and ``ctl status --url U`` both work)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "--url",
        default=default(os.environ.get("OMNISTAGE_URL", "http://127.0.0.1:8000")),
        help="Server URL (default: $OMNISTAGE_URL or http://127.0.0.1:8000).",
    )
    p.add_argument(
        "--api-key",
        default=default(
            os.environ.get("OMNISTAGE_CONTROL_API_KEY") or os.environ.get("OMNISTAGE_API_KEY")
        ),
        help="Key sent as 'Authorization: Bearer' (default: $OMNISTAGE_CONTROL_API_KEY or $OMNISTAGE_API_KEY).",
    )
    p.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="Print the raw JSON response.",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ctl",
        help="Control a running server: status, sleep, wakeup, pause, resume, update-weights.",
    )
    _connection_flags(p, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _connection_flags(common, suppress=True)
    ops = p.add_subparsers(dest="op", required=True)
    ops.add_parser("status", parents=[common], help="Show every stage's state and memory.")
    s = ops.add_parser("sleep", parents=[common], help="Put stages to sleep.")
    s.add_argument("stage_ids", type=int, nargs="+", help="Stage ids.")
    s.add_argument(
        "--level",
        type=int,
        default=DEFAULT_SLEEP_LEVEL,
        choices=SLEEP_LEVELS,
        help=f"Sleep level (default: {DEFAULT_SLEEP_LEVEL}; 0 pauses, 1 keeps a host copy of "
        "the weights, 2 drops them and reloads on wake).",
    )
    s.add_argument("--mode", choices=SLEEP_MODES, help="What happens to in-flight requests.")
    s.add_argument("--tags", nargs="+", choices=KNOWN_TAGS, help="Only these memory tags.")
    s.add_argument("--replica-ids", type=int, nargs="+", help="Only these replicas of each stage.")
    w = ops.add_parser("wakeup", parents=[common], help="Wake stages.")
    w.add_argument("stage_ids", type=int, nargs="+", help="Stage ids.")
    w.add_argument("--tags", nargs="+", choices=KNOWN_TAGS, help="Only these memory tags.")
    w.add_argument("--replica-ids", type=int, nargs="+", help="Only these replicas of each stage.")
    w.add_argument(
        "--no-reload", action="store_true", help="After level 2, leave weights for update-weights."
    )
    w.add_argument("--no-resume", action="store_true", help="Keep the stages paused after waking.")
    for name in ("pause", "resume"):
        q = ops.add_parser(
            name,
            parents=[common],
            help=f"{name.capitalize()} admission to stages (all by default).",
        )
        q.add_argument("stage_ids", type=int, nargs="*", help="Stage ids (default: all).")
        if name == "pause":
            q.add_argument(
                "--mode",
                choices=SLEEP_MODES,
                default=DEFAULT_SLEEP_MODE,
                help="In-flight requests.",
            )
    u = ops.add_parser(
        "update-weights",
        parents=[common],
        help="Load a safetensors file or folder into a stage's weights.",
    )
    u.add_argument("stage_id", type=int, help="Stage id.")
    u.add_argument("path", help="Path on the server's machine.")
    p.set_defaults(func=run)


def _body(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    if args.op == "status":
        return "GET", "/v1/omni/stages", None
    if args.op == "sleep":
        body: dict[str, Any] = {"stage_ids": args.stage_ids, "level": args.level}
        if args.mode:
            body["mode"] = args.mode
        if args.tags:
            body["tags"] = args.tags
        if args.replica_ids:
            body["replica_ids"] = args.replica_ids
        return "POST", "/v1/omni/sleep", body
    if args.op == "wakeup":
        body = {"stage_ids": args.stage_ids}
        if args.tags:
            body["tags"] = args.tags
        if args.no_reload:
            body["reload"] = False
        if args.no_resume:
            body["resume"] = False
        if args.replica_ids:
            body["replica_ids"] = args.replica_ids
        return "POST", "/v1/omni/wakeup", body
    if args.op in ("pause", "resume"):
        body = {"stage_ids": args.stage_ids or None}
        if args.op == "pause":
            body["mode"] = args.mode
        return "POST", f"/v1/omni/{args.op}", body
    return "POST", "/v1/omni/update_weights", {"stage_id": args.stage_id, "path": args.path}


def _mib(n: Any) -> str:
    return f"{int(n) / 2**20:.1f}" if isinstance(n, int | float) else "-"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows
    )


def _weights_cell(status: dict[str, Any]) -> str:
    if "weights" in (status.get("sleeping_tags") or []):
        return "asleep"
    return "ok" if status.get("weights_valid", True) else "INVALID"


def _texts(item: dict[str, Any], *keys: str) -> list[str]:
    return [str(item.get(key)) for key in keys]


STAGE_HEADER = ["STAGE", "KIND", "STATE", "LEVEL", "PAUSED", "IN-FLIGHT", "WEIGHTS", "RESIDENT MiB"]


def _stage_row(s: dict[str, Any]) -> list[str]:
    return [
        *_texts(s, "stage_id", "kind", "state"),
        "-" if s.get("level") is None else str(s.get("level")),
        *_texts(s, "paused", "in_flight"),
        _weights_cell(s),
        _mib((s.get("memory") or {}).get("resident_bytes")),
    ]


def _stage_rows(s: dict[str, Any]) -> list[list[str]]:
    """A stage's row, then one per replica (``STAGE.REPLICA``) for a replicated stage."""
    rows = [_stage_row(s)]
    for r in s.get("replicas") or []:
        rows.append(
            [
                f"{s.get('stage_id')}.{r.get('replica_id')}",
                "replica",
                str(r.get("state")),
                "-" if r.get("level") is None else str(r.get("level")),
                "-",
                str(r.get("in_flight")),
                "-",
                _mib((r.get("memory") or {}).get("resident_bytes")),
            ]
        )
    return rows


ACK_HEADER = ["STAGE", "STATUS", "FREED MiB", "LATENCY ms", "GB/s", "TAGS", "ERROR"]


def _ack_row(a: dict[str, Any]) -> list[str]:
    meta = a.get("metadata") or {}
    stage = str(a.get("stage_id"))
    if a.get("replica_id") is not None:
        stage += f".{a['replica_id']}"
    return [
        stage,
        str(a.get("status")),
        _mib(a.get("freed_bytes")),
        f"{float(meta.get('latency_ms') or 0):.1f}",
        f"{float(meta.get('gbps') or 0):.2f}" if meta.get("gbps") else "-",
        ",".join(meta.get("tags") or []) or "-",
        a.get("error_msg") or "",
    ]


def format_response(op: str, data: Any) -> str:
    if op == "status":
        stages = data.get("stages", data) if isinstance(data, dict) else data
        return table([STAGE_HEADER, *(row for s in stages for row in _stage_rows(s))])
    lines = [
        f"status: {data.get('status')}" + (f" ({data['reason']})" if data.get("reason") else "")
    ]
    acks = data.get("acks") or []
    if acks:
        lines.append(table([ACK_HEADER, *map(_ack_row, acks)]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    method, path, body = _body(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.request(
            method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=600
        )
    except httpx.HTTPError as exc:
        print(
            f"error: cannot reach {args.url}: {exc} (another server: --url or $OMNISTAGE_URL)",
            file=sys.stderr,
        )
        return 2
    try:
        data = response.json()
    except json.JSONDecodeError:
        data = {"status": "ERROR", "reason": response.text}
    if args.json:
        print(json.dumps(data, indent=2))
    elif response.status_code >= 400:
        line = error_line(response.status_code, data)
        if response.status_code == 401:
            line += (
                " (the control key: --api-key, or $OMNISTAGE_CONTROL_API_KEY / $OMNISTAGE_API_KEY)"
            )
        print(line, file=sys.stderr)
    else:
        print(format_response(args.op, data))
    # 200 with status ERROR: some stage failed the operation (its ACK says why); scripts
    # chaining ``ctl sleep 0 && train`` must not go on.
    failed = response.status_code >= 400 or (
        isinstance(data, dict) and data.get("status") == "ERROR"
    )
    return 1 if failed else 0


def error_line(status: int, data: Any) -> str:
    """A refused call as one line: ``error: HTTP 409 stage_busy: stage 0 is busy ...``."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message")
    else:
        code = None
        message = data.get("detail") or data.get("reason") if isinstance(data, dict) else data
    label = f"HTTP {status}" + (f" {code}" if code else "")
    return f"error: {label}: {' '.join(str(message or '').split())}"
