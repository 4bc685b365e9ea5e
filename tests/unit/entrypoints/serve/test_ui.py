"""The page at /ui: served from the package's files without a key but holding no data, locked
down by its Content-Security-Policy, gone with --no-ui; the control vocabulary it offers is
the server's; the ACK journal behind its table (``GET /v1/omni/acks``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from omnistage.entrypoints.cli_args import add_serve_arguments, server_config
from omnistage.entrypoints.openai.api_server import build_app, ready_banner
from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.entrypoints.serve import ui
from omnistage.entrypoints.serve.omni_control.journal import ControlJournal
from omnistage.stage import vocabulary
from omnistage.stage.control import make_ack
from tests.unit.entrypoints.serve.conftest import ClientFactory, FakeEngine


def _client(**options: object) -> TestClient:
    # The lifespan is not entered: the page's routes read no engine.
    config = ServerConfig(api_key="data-secret", control_api_key="ctl-secret", **options)
    app = build_app(config, engine_client=object())
    app.state.api_key, app.state.control_api_key = config.api_key, config.control_api_key
    return TestClient(app)


def test_the_page_loads_without_a_key_and_holds_no_data() -> None:
    client = _client()
    moved = client.get("/ui", follow_redirects=False)
    assert moved.status_code == 307 and moved.headers["location"] == "ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    # No inline script or style (the policy would block them) and nothing from another host.
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text)
    assert "<style" not in page.text and " style=" not in page.text
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    assert client.get("/v1/models").status_code == 401  # the data stays behind the key
    assert client.get("/v1/omni/acks").status_code == 401


def test_every_file_the_page_names_is_served_as_what_it_is() -> None:
    client = _client()
    names = re.findall(r"(?:src|href)=\"static/([^\"]+)\"", client.get("/ui/").text)
    imported = {
        name
        for path in ui.STATIC.glob("*.js")
        for name in re.findall(r"from \"\./([\w.]+)\"", path.read_text())
    }
    assert {"app.js", "ui.css"} <= set(names) and imported <= {p.name for p in ui.STATIC.iterdir()}
    for name in {*names, *imported}:
        reply = client.get(f"/ui/static/{name}")
        assert reply.status_code == 200, name
        expected = "text/css" if name.endswith(".css") else "javascript"
        assert expected in reply.headers["content-type"], name
        assert reply.headers["x-content-type-options"] == "nosniff"
    assert client.get("/ui/static/../ui.py").status_code == 404


def test_nothing_loads_from_elsewhere() -> None:
    for path in ui.STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), path.name
        assert "innerHTML" not in text and "eval(" not in text, path.name


def test_the_forms_offer_the_servers_vocabulary() -> None:
    said = _client().get("/ui/vocabulary.json").json()
    assert said["levels"] == list(vocabulary.SLEEP_LEVELS)
    assert said["default_level"] == vocabulary.DEFAULT_SLEEP_LEVEL
    assert said["modes"] == list(vocabulary.SLEEP_MODES)
    assert said["tags"] == list(vocabulary.MEMORY_TAGS)


def test_no_ui_turns_the_page_off() -> None:
    client = _client(no_ui=True)
    assert client.get("/ui/").status_code == 404
    assert client.get("/ui/static/app.js").status_code == 404
    assert "/ui" not in ready_banner(ServerConfig(no_ui=True), 8000)
    assert "http://127.0.0.1:8000/ui" in ready_banner(ServerConfig(), 8000)


def test_no_ui_is_a_flag_with_help() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    help_line = parser.format_help().split("\n  --no-ui", 1)[1].split("\n  --", 1)[0]
    assert "/ui" in help_line
    config = server_config(parser.parse_args(["--no-ui"]))
    assert config is not None and config.no_ui
    config = server_config(parser.parse_args([]))
    assert config is not None and not config.no_ui


def test_the_page_ships_in_the_package_data() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[4]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["omnistage"]
    package = root / "omnistage"
    shipped = {p for pattern in patterns for p in package.glob(pattern)}
    assert set(ui.STATIC.iterdir()) <= shipped


def test_the_journal_keeps_the_last_operations_in_order() -> None:
    journal = ControlJournal(length=3)
    for stage_id in range(5):
        journal.record("sleep", [make_ack(stage_id, freed_bytes=10).to_dict()])
    entries = journal.entries()
    assert [e["seq"] for e in entries] == [3, 4, 5]
    assert [e["acks"][0]["stage_id"] for e in entries] == [2, 3, 4]
    assert [e["seq"] for e in journal.entries(after=4)] == [5]
    assert [e["seq"] for e in journal.entries(limit=1)] == [5]
    assert journal.last_seq == 5 and ControlJournal().last_seq == 0


@pytest.mark.parametrize("query", ["", "?limit=1", "?after=1"])
def test_the_acks_route_serves_the_journal(client_for: ClientFactory, query: str) -> None:
    client = client_for(FakeEngine(), control_api_key="ctl-secret")
    journal = ControlJournal()
    client.app.state.control_journal = journal  # type: ignore[attr-defined]
    journal.record("sleep", [make_ack(1, freed_bytes=1024, level=2).to_dict()])
    journal.record("wake_up", [make_ack(1).to_dict()])
    headers = {"Authorization": "Bearer ctl-secret"}
    assert client.get("/v1/omni/acks").status_code == 401
    reply = client.get(f"/v1/omni/acks{query}", headers=headers)
    assert reply.status_code == 200
    operations = reply.json()["operations"]
    expected = {"": ["sleep", "wake_up"], "?limit=1": ["wake_up"], "?after=1": ["wake_up"]}
    assert [op["operation"] for op in operations] == expected[query]
    assert operations[-1]["acks"][0]["stage_id"] == 1
    assert reply.json()["last_seq"] == 2
    assert client.get("/v1/omni/acks?limit=0", headers=headers).status_code == 400
