"""A real family's pipeline over HTTP, read with the official openai client: tiny-flux's image
for a seed equals diffusers' FluxPipeline for the same folder; bad input is a 400 naming the
field; a sleeping text encoder answers 503 and wakes to the same image."""

import base64
import io
import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.e2e.server import running_server

EXTRA = {"seed": 5, "num_inference_steps": 3}
SIZE = "48x32"  # width x height


@pytest.fixture(scope="module")
def server():
    with running_server("--pipeline", "tiny-flux", "--enable-sleep-mode") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers={"Connection": "close"},
    )


@pytest.fixture(scope="module")
def reference(server):
    """diffusers' FluxPipeline on the folder the server built."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(Path(os.environ["OMNISTAGE_CACHE_DIR"]) / "tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_png_pixels(pipe, seed: int) -> np.ndarray:
    """The reference's image quantised as a PNG is."""
    image = pipe(
        "a red cat",
        height=32,
        width=48,
        num_inference_steps=3,
        guidance_scale=3.5,  # FluxPipeline's default, and the family's
        max_sequence_length=64,  # the tiny T5 tokenizer's model_max_length
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images[0]
    return (image * 255).round().astype(np.uint8)


def generate(client, **kwargs) -> list[np.ndarray]:
    result = client.images.generate(
        model="tiny-flux", prompt="a red cat", size=SIZE, response_format="b64_json", **kwargs
    )
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json))).convert("RGB"))
        for d in result.data
    ]


def test_the_openai_client_gets_diffusers_image(client, reference):
    images = generate(client, n=2, extra_body=EXTRA)
    assert len(images) == 2 and images[0].shape == (32, 48, 3)
    assert np.array_equal(images[0], reference_png_pixels(reference, 5))
    assert np.array_equal(images[1], reference_png_pixels(reference, 6))  # seed, seed + 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quality": "hd"}, "quality"),
        ({"size": "50x32"}, "width"),
        ({"size": "4096x4096"}, "size"),
        ({"extra_body": {"negative_prompt": "blurry"}}, "negative_prompt"),
        ({"extra_body": {"num_inference_steps": 0}}, "num_inference_steps"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="tiny-flux", prompt="a red cat", **{"size": SIZE, **kwargs})
    assert field in str(err.value)


def test_a_sleeping_text_encoder_answers_503_then_wakes_to_the_same_image(server, client):
    before = generate(client, extra_body=EXTRA)[0]
    sleep = httpx.post(
        f"{server.url}/v1/omni/sleep",
        json={"stage_ids": [0], "level": 2, "tags": ["text_encoders"]},
        timeout=60,
    )
    assert sleep.status_code == 200 and sleep.json()["acks"][0]["status"] == "SUCCESS"
    assert sleep.json()["acks"][0]["metadata"]["tags"] == ["text_encoders"]
    stages = httpx.get(f"{server.url}/v1/omni/stages", timeout=60).json()["stages"]
    memory = stages[0]["memory"]["tags"]
    assert memory["text_encoders"]["resident_bytes"] == 0
    assert memory["transformer"]["resident_bytes"] == memory["transformer"]["reserved_bytes"]
    with pytest.raises(openai.APIStatusError) as err:
        generate(client, extra_body=EXTRA)
    assert err.value.status_code == 503
    wake = httpx.post(
        f"{server.url}/v1/omni/wakeup", json={"stage_ids": [0], "tags": ["weights"]}, timeout=60
    )
    assert wake.status_code == 200 and wake.json()["status"] == "SUCCESS"
    assert np.array_equal(generate(client, extra_body=EXTRA)[0], before)


def chat_images(server, body: dict) -> list[np.ndarray]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",")[1]))))
        for p in choice["message"]["content"]
    ]


def test_image_generation_through_chat_as_vllm_omni_clients_send_it(server, reference):
    """vLLM-Omni's curl shape: no model, no modalities, the parameters in a literal
    extra_body object; the pictures as message.content parts, image i with seed + i."""
    body = {
        "messages": [{"role": "user", "content": "a red"}, {"role": "user", "content": "cat"}],
        "extra_body": {"height": 32, "width": 48, "num_inference_steps": 3, "seed": 5,
                       "num_outputs_per_prompt": 2},
    }  # fmt: skip
    images = chat_images(server, body)
    assert [i.shape for i in images] == [(32, 48, 3)] * 2
    assert np.array_equal(images[0], reference_png_pixels(reference, 5))
    assert np.array_equal(images[1], reference_png_pixels(reference, 6))
    refused = {**body, "extra_body": {**body["extra_body"], "true_cfg_scale": 4.0}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=refused, timeout=60)
    assert r.status_code == 400 and "FluxPipeline" in r.json()["error"]["message"], r.text
