"""``omnistage ctl``: exit status of control operations (HTTP replaced by a stub)."""

import argparse

import httpx
import pytest

from omnistage.entrypoints import ctl
from omnistage.stage.control import make_ack


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ctl.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["ctl", *argv])


@pytest.mark.parametrize(("status", "code"), [("SUCCESS", 0), ("SKIPPED", 0), ("ERROR", 1)])
def test_exit_status_follows_the_operation_status(monkeypatch, capsys, status, code):
    ack = make_ack(
        0, status="ERROR" if status == "ERROR" else "SUCCESS", error_msg="boom"
    ).to_dict()
    reply = {"status": status, "acks": [ack]}
    monkeypatch.setattr(httpx, "request", lambda *a, **k: httpx.Response(200, json=reply))
    for argv in (("sleep", "0"), ("--json", "sleep", "0")):
        assert ctl.run(parse(*argv)) == code


@pytest.mark.parametrize(
    "argv",
    [
        ["ctl", "--url", "http://h:1", "--api-key", "k", "--json", "sleep", "0"],
        ["ctl", "sleep", "0", "--url", "http://h:1", "--api-key", "k", "--json"],
        ["ctl", "--url", "http://h:1", "sleep", "--api-key", "k", "0", "--json"],
    ],
)
def test_connection_flags_go_before_or_after_the_subcommand(argv):
    from omnistage.cli import build_parser

    args = build_parser().parse_args(argv)
    assert (args.url, args.api_key, args.json, args.stage_ids) == ("http://h:1", "k", True, [0])


def test_the_ack_table_shows_the_achieved_throughput(monkeypatch, capsys):
    ack = make_ack(0, latency_ms=12.5, restored_bytes=2**30, gbps=85.9, tags=["weights"])
    reply = {"status": "SUCCESS", "acks": [ack.to_dict()]}
    monkeypatch.setattr(httpx, "request", lambda *a, **k: httpx.Response(200, json=reply))
    assert ctl.run(parse("wakeup", "0")) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "85.90" in out and "12.5" in out


@pytest.mark.parametrize(
    ("status", "body", "line"),
    [
        (401, {"error": {"message": "missing or invalid API key", "code": "unauthorized"},
               "detail": "missing or invalid API key"},
         "error: HTTP 401 unauthorized: missing or invalid API key (the control key: "
         "--api-key, or $OMNISTAGE_CONTROL_API_KEY / $OMNISTAGE_API_KEY)"),
        (501, {"error": {"message": "Engine does not support sleep", "code": "not_implemented"}},
         "error: HTTP 501 not_implemented: Engine does not support sleep"),
        (409, {"error": {"message": "stage 0 is busy (waking);\nretry", "code": "stage_busy"}},
         "error: HTTP 409 stage_busy: stage 0 is busy (waking); retry"),
        (502, {"detail": "bad gateway"}, "error: HTTP 502: bad gateway"),
    ],
)  # fmt: skip
def test_a_refused_call_is_one_readable_line_not_a_json_dump(
    monkeypatch, capsys, status, body, line
):
    monkeypatch.setattr(httpx, "request", lambda *a, **k: httpx.Response(status, json=body))
    assert ctl.run(parse("sleep", "0")) == 1
    out = capsys.readouterr()
    assert out.err.strip() == line and out.out == ""
    assert ctl.run(parse("--json", "sleep", "0")) == 1  # --json still prints the body
    assert '"error"' in capsys.readouterr().out or status == 502


def test_what_a_newcomer_needs_is_in_the_message(monkeypatch, capsys):
    """Where to point ctl, an awake stage's level, the default sleep level."""

    def unreachable(*args, **kwargs):
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(httpx, "request", unreachable)
    assert ctl.run(parse("--url", "http://127.0.0.1:9", "status")) == 2
    assert "--url or $OMNISTAGE_URL" in capsys.readouterr().err
    stages = {"stages": [{"stage_id": 0, "kind": "ar", "state": "awake", "level": None},
                         {"stage_id": 1, "kind": "ar", "state": "asleep", "level": 2}]}  # fmt: skip
    monkeypatch.setattr(httpx, "request", lambda *a, **k: httpx.Response(200, json=stages))
    assert ctl.run(parse("status")) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[3] == "-" and rows[2].split()[3] == "2"  # LEVEL, not None
    parser = argparse.ArgumentParser()
    ctl.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["ctl", "sleep", "--help"])
    assert f"default: {ctl.DEFAULT_SLEEP_LEVEL}" in " ".join(capsys.readouterr().out.split())
