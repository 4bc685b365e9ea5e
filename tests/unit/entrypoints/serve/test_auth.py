"""--api-key and --control-api-key: who may call which route."""

from __future__ import annotations

import pytest

from omnistage.config import ConfigError
from omnistage.entrypoints.serve.auth import CONTROL_API_KEY_ENV, resolve_control_api_key
from tests.unit.entrypoints.serve.conftest import ClientFactory, FakeEngine

CONTROL_ROUTES = [
    ("POST", "/v1/omni/sleep", {"stage_ids": [0]}),
    ("POST", "/v1/omni/wakeup", {"stage_ids": [0]}),
    ("GET", "/v1/omni/stages", None),
    ("GET", "/v1/omni/acks", None),
    ("POST", "/v1/omni/pause", None),
    ("POST", "/v1/omni/resume", None),
    ("POST", "/v1/omni/update_weights", {"stage_id": 0, "path": "/ckpt"}),
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_ROUTES)
@pytest.mark.parametrize("headers", [{}, _bearer("wrong"), {"Authorization": "ctl-secret"}])
def test_control_routes_refuse_missing_or_wrong_control_key(
    client_for: ClientFactory, method: str, path: str, body: dict | None, headers: dict
) -> None:
    engine = FakeEngine()
    client = client_for(engine, control_api_key="ctl-secret")
    reply = client.request(method, path, json=body, headers=headers)
    assert reply.status_code == 401
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    assert engine.calls == []


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_ROUTES)
def test_control_routes_accept_the_control_key(
    client_for: ClientFactory, method: str, path: str, body: dict | None
) -> None:
    client = client_for(FakeEngine(), control_api_key="ctl-secret")
    assert client.request(method, path, json=body, headers=_bearer("ctl-secret")).status_code == 200


def test_data_route_is_unaffected_by_the_control_key(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), control_api_key="ctl-secret")
    assert client.post("/v1/chat/completions").status_code == 200


def test_api_key_alone_guards_control_and_data_routes(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), api_key="api-secret")
    assert client.post("/v1/omni/sleep", json={"stage_ids": [0]}).status_code == 401
    assert client.post("/v1/chat/completions").status_code == 401
    assert client.post("/sleep", headers=_bearer("api-secret")).status_code == 200
    assert client.post("/v1/chat/completions", headers=_bearer("api-secret")).status_code == 200


def test_with_both_keys_control_routes_demand_the_control_key(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), api_key="api-secret", control_api_key="ctl-secret")
    assert client.post("/sleep", headers=_bearer("api-secret")).status_code == 401
    assert client.post("/sleep", headers=_bearer("ctl-secret")).status_code == 200
    assert client.post("/v1/chat/completions", headers=_bearer("ctl-secret")).status_code == 401


def test_health_is_exempt_from_the_api_key(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), api_key="api-secret", control_api_key="ctl-secret")
    assert client.get("/health").status_code == 200


def test_bearer_scheme_is_case_insensitive(client_for: ClientFactory) -> None:
    client = client_for(FakeEngine(), control_api_key="ctl-secret")
    reply = client.get("/is_sleeping", headers={"Authorization": "bearer ctl-secret"})
    assert reply.status_code == 200


def test_401_reply_does_not_reveal_the_key(client_for: ClientFactory) -> None:
    reply = client_for(FakeEngine(), control_api_key="ctl-secret").post("/resume")
    assert "ctl-secret" not in reply.text
    assert reply.json()["error"]["type"] == "authentication_error"


def test_control_key_comes_from_the_flag_then_the_environment() -> None:
    environ = {CONTROL_API_KEY_ENV: "from-env"}
    assert resolve_control_api_key("from-flag", environ) == "from-flag"
    assert resolve_control_api_key(None, environ) == "from-env"
    assert resolve_control_api_key(None, {}) is None
    for blank in ("", "  ", " key"):  # set but blank: refused, never "no key"
        with pytest.raises(ConfigError, match=CONTROL_API_KEY_ENV):
            resolve_control_api_key(None, {CONTROL_API_KEY_ENV: blank})
