"""The official openai client against a real server, across sleep and wake of stages."""

import base64
import json
import socket
import time

import httpx
import openai
import pytest

GREEDY = {"temperature": 0.0, "max_tokens": 12}
IMAGE_EXTRA = {"seed": 3, "num_inference_steps": 4}


@pytest.fixture(scope="module")
def client(omni_server):
    # Connection: close — no kept-alive socket for the server's idle timeout to race with.
    return openai.OpenAI(
        base_url=omni_server.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers={"Connection": "close"},
    )


def chat(client, text="Hello there", **kwargs):
    return client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": text}], **{**GREEDY, **kwargs}
    )


def image(client):
    result = client.images.generate(
        model="tiny-omni", prompt="a blue circle", size="64x64", extra_body=IMAGE_EXTRA
    )
    return base64.b64decode(result.data[0].b64_json)


def test_chat_non_streaming_and_streaming_agree(client):
    full = chat(client)
    assert full.choices[0].message.content
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    chunks = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Hello there"}],
        stream=True,
        **GREEDY,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content


def test_a_chat_without_max_tokens_may_take_the_rest_of_the_context(client):
    """As vLLM's chat, not SamplingParams' 16 tokens: 20 tokens at least, then any of half
    the vocabulary ends it (a 400 "min_tokens must not exceed max_tokens" if 16 applied)."""
    reply = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Hello there"}],
        temperature=0.0,
        extra_body={"min_tokens": 20, "stop_token_ids": list(range(256))},
    )
    assert reply.usage.completion_tokens > 16
    assert reply.choices[0].finish_reason == "stop"


def png_of(part):
    assert part["type"] == "image_url"
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    png = base64.b64decode(url.split(",", 1)[1])
    assert png.startswith(b"\x89PNG")
    return png


def test_text_and_image_answer_parses_cleanly_in_the_openai_client(client):
    """Text in ``content`` (a string, as the client types it), the image as a PNG content part
    in ``images``; the text hit max_tokens, so the choice ends with "length"."""
    import warnings

    reply = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "draw"}],
        temperature=0.0,
        max_tokens=3,
        extra_body={"modalities": ["text", "image"], "ignore_eos": True, **IMAGE_EXTRA},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic serializer warnings fail the test
        dumped = reply.model_dump()
    (choice,) = dumped["choices"]
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    (part,) = choice["message"]["images"]
    png_of(part)


def test_a_streamed_text_and_image_answer_ends_with_length_too(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny-omni",
            messages=[{"role": "user", "content": "draw"}],
            temperature=0.0,
            max_tokens=3,
            stream=True,
            extra_body={"modalities": ["text", "image"], "ignore_eos": True, **IMAGE_EXTRA},
        )
    )
    images = [p for c in chunks for p in (c.choices[0].delta.model_extra or {}).get("images") or []]
    assert len(images) == 1 and png_of(images[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_an_image_only_answer_has_no_text(omni_server):
    r = httpx.post(
        omni_server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "draw"}],
            "modalities": ["image"],
            **GREEDY,
            **IMAGE_EXTRA,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and png_of(message["images"][0])


def test_image_stage_sleep_keeps_text_working_and_wake_restores_exact_outputs(client, omni_server):
    text_before = chat(client).choices[0].message.content
    png_before = image(client)
    r = httpx.post(
        omni_server.url + "/v1/omni/sleep",
        json={"stage_ids": [1], "level": 1},
        headers=omni_server.control_headers(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    try:
        assert chat(client).choices[0].message.content == text_before
        raw = httpx.post(
            omni_server.url + "/v1/images/generations",
            json={"prompt": "x", **IMAGE_EXTRA},
            timeout=60,
        )
        assert raw.status_code == 503 and "stage 1" in raw.text
        assert raw.headers["Retry-After"] == "1"  # SPEC: every sleeping-stage 503 carries it
        with pytest.raises(openai.APIStatusError) as info:
            image(client)
        assert info.value.status_code == 503
    finally:
        r = httpx.post(
            omni_server.url + "/v1/omni/wakeup",
            json={"stage_ids": [1]},
            headers=omni_server.control_headers(),
            timeout=60,
        )
    assert r.json()["status"] == "SUCCESS"
    assert chat(client).choices[0].message.content == text_before
    assert image(client) == png_before


def test_models_and_metrics(omni_server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-omni"]
    metrics = httpx.get(omni_server.url + "/metrics").text
    assert "omnistage:stage_state" in metrics and "omnistage:engine_sleep_state" in metrics


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, "modalities"),
    ],
)
def test_bad_chat_bodies_name_the_field(omni_server, body, field):
    r = httpx.post(omni_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_malformed_json_is_400(omni_server):
    r = httpx.post(
        omni_server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400


def stage0_in_flight(server) -> int:
    r = httpx.get(server.url + "/v1/omni/stages", headers=server.control_headers(), timeout=30)
    return int(r.json()["stages"][0]["in_flight"])


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_client_hanging_up_on_a_non_streaming_chat_aborts_its_request(omni_server):
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "go"}],
            "temperature": 0.0,
            "max_tokens": 480,
            "ignore_eos": True,
        }
    ).encode()
    port = int(omni_server.url.rsplit(":", 1)[1])
    control = {"json": {"stage_ids": [0]}, "headers": omni_server.control_headers()}
    conn = socket.create_connection(("127.0.0.1", port))
    try:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert wait_for(lambda: stage0_in_flight(omni_server) == 1, 10)
        # Preempted and kept: without an abort it would stay in flight until resumed.
        pause = {**control, "json": {"stage_ids": [0], "mode": "keep"}}
        assert httpx.post(omni_server.url + "/v1/omni/pause", **pause).status_code == 200
        conn.close()
        assert wait_for(lambda: stage0_in_flight(omni_server) == 0, 5)
    finally:
        conn.close()
        httpx.post(omni_server.url + "/v1/omni/resume", **control)
