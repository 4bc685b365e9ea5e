import pytest

from tests.e2e.server import running_server

CONTROL_KEY = "ctl-secret"


@pytest.fixture(scope="package")
def omni_server():
    """tiny-omni with sleep mode and a control key, shared by the e2e tests. Its chats mean
    text unless they say otherwise and answer in OpenAI's shape (``--default-modalities text
    --chat-dialect openai``), as the tests using it were written; vLLM-Omni's defaults
    (every output, a choice per modality) are tested on the family servers
    (test_qwen2_5_omni_api.py, test_diffusion_families_api.py) and in
    tests/unit/entrypoints/test_chat_dialects.py."""
    with running_server(
        "--pipeline", "tiny-omni", "--enable-sleep-mode", "--control-api-key", CONTROL_KEY,
        "--default-modalities", "text", "--chat-dialect", "openai",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="package")
def plain_server():
    """tiny-chat without sleep mode."""
    with running_server("--pipeline", "tiny-chat") as server:
        yield server
