import pytest

from tests.e2e.server import running_server

CONTROL_KEY = "ctl-secret"


@pytest.fixture(scope="package")
def omni_server():
    """tiny-omni with sleep mode and a control key, shared by the e2e tests."""
    with running_server(
        "--pipeline", "tiny-omni", "--enable-sleep-mode", "--control-api-key", CONTROL_KEY
    ) as server:
        yield server


@pytest.fixture(scope="package")
def plain_server():
    """tiny-chat without sleep mode."""
    with running_server("--pipeline", "tiny-chat") as server:
        yield server
