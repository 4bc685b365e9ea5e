"""Wan text-to-video over HTTP: ``POST /v1/videos`` in vLLM-Omni's shape, called with the
official openai client's ``videos.create`` (a multipart form): the MP4's frames for a seed are
diffusers' WanPipeline's for the same folder, encoded the same way; the frame count, rate and
size are the request's. Bad input is a 400 naming the field; the image route still answers,
with one frame."""

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

from omnistage.stage.diffusion.video import quantise, read_mp4, to_mp4
from tests.e2e.server import running_server
from tests.unit.stage.diffusion.family_cases import float32_load

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "a red cat"
FIELDS = {"seed": 5, "num_inference_steps": 2, "num_frames": 5, "fps": 8}


@pytest.fixture(scope="module")
def server():
    with running_server("--pipeline", "tiny-wan", "--enable-sleep-mode") as server:
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
    """diffusers' WanPipeline on the folder the server built."""
    from diffusers import WanPipeline

    folder = Path(os.environ["OMNISTAGE_CACHE_DIR"]) / "tiny-wan"
    with float32_load(folder):
        pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_frames(pipe, seed: int, num_frames: int) -> np.ndarray:
    return pipe(
        PROMPT,
        height=32,
        width=48,
        num_frames=num_frames,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).frames[0]


def encoded_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    decoded = read_mp4(to_mp4(quantise(torch.from_numpy(theirs)), 8))[0]
    return float(np.abs(ours.astype(np.int16) - decoded.astype(np.int16)).mean())


def test_the_openai_client_gets_diffusers_video_as_mp4(client, reference):
    video = client.videos.create(model="tiny-wan", prompt=PROMPT, size="48x32", extra_body=FIELDS)
    data = video.model_extra["data"][0]
    assert (data["num_frames"], data["fps"], data["width"], data["height"]) == (5, 8, 48, 32)
    assert data["seed"] == 5
    frames, fps = read_mp4(base64.b64decode(data["b64_json"]))
    assert frames.shape == (5, 32, 48, 3) and fps == 8
    # diffusers' frames through the same encoder: the same MP4 but for x264's last-bit
    # wobble between runs (a mean pixel difference near 0; another seed's differs by ~8)
    assert encoded_difference(frames, reference_frames(reference, 5, 5)) < 1
    assert encoded_difference(frames, reference_frames(reference, 6, 5)) > 3


def test_the_image_route_gives_one_frame(client, reference):
    result = client.images.generate(
        model="tiny-wan",
        prompt=PROMPT,
        size="48x32",
        extra_body={"seed": 3, "num_inference_steps": 2},
    )
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))))
    expected = reference_frames(reference, 3, 1)[0]
    assert np.array_equal(image, (expected * 255).round().astype(np.uint8))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"size": "50x32"}, "width"),
        ({"num_frames": "85"}, "num_frames"),  # more than Wan 2.1's 81
        ({"num_frames": "6"}, "num_frames"),  # not 1 + a multiple of 4
        ({"fps": "0"}, "fps"),
        ({"fps": "500"}, "fps"),
        ({"num_inference_steps": "0"}, "num_inference_steps"),
        ({"seconds": "4"}, "seconds"),  # without fps
        ({"guidance_scale_2": "3"}, "guidance_scale_2"),  # Wan 2.2's: not served
        ({"response_format": "url"}, "response_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, fields, field):
    form = {"prompt": PROMPT, "size": "48x32", **fields}
    reply = httpx.post(f"{server.url}/v1/videos", files={k: (None, v) for k, v in form.items()})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


def test_an_uploaded_file_is_a_400_naming_it(server):
    files = {"prompt": (None, PROMPT), "input_reference": ("cat.png", b"\x89PNG", "image/png")}
    reply = httpx.post(f"{server.url}/v1/videos", files=files)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_reference"
