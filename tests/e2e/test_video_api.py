"""Wan text-to-video over HTTP: video jobs (``POST /v1/videos`` and its routes) and
``/v1/videos/sync`` in vLLM-Omni's shape, driven by the official openai client's ``videos``
(``create_and_poll``, ``download_content``, ``list``, ``delete``: a multipart form): the MP4's
frames for a seed are diffusers' WanPipeline's for the same folder, encoded the same way; the
frame count (on Wan's grid), rate and size are the request's. Bad input is a 400 naming the
field before any job starts; the image route still answers, with one frame."""

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


def test_the_openai_client_makes_a_job_and_downloads_diffusers_video(client, reference):
    video = client.videos.create_and_poll(
        model="tiny-wan", prompt=PROMPT, size="48x32", extra_body=FIELDS, poll_interval_ms=50
    )
    assert (video.status, video.progress, video.object, video.size) == (
        "completed", 100, "video", "48x32",
    )  # fmt: skip
    extra = video.model_extra
    assert (extra["num_frames"], extra["fps"], extra["seed"]) == (5, 8, 5)
    assert client.videos.retrieve(video.id).status == "completed"
    frames, fps = read_mp4(client.videos.download_content(video.id).content)
    assert frames.shape == (5, 32, 48, 3) and fps == 8
    # diffusers' frames through the same encoder: the same MP4 but for x264's last-bit
    # wobble between runs (a mean pixel difference near 0; another seed's differs by ~8)
    assert encoded_difference(frames, reference_frames(reference, 5, 5)) < 1
    assert encoded_difference(frames, reference_frames(reference, 6, 5)) > 3
    assert video.id in [v.id for v in client.videos.list()]
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_seconds_take_the_familys_frame_rate_and_the_grid(client):
    """OpenAI's ``seconds`` without an fps: Wan's 16 fps, 16 frames on the 1 + 4k grid."""
    job = client.videos.create(
        model="tiny-wan", prompt=PROMPT, size="48x32", seconds="1",
        extra_body={"seed": 1, "num_inference_steps": 1},
    )  # fmt: skip
    assert job.id and job.status in ("queued", "in_progress") and job.seconds == "1"
    done = client.videos.poll(job.id, poll_interval_ms=50)
    assert (done.model_extra["num_frames"], done.model_extra["fps"]) == (17, 16)


def test_the_sync_route_answers_the_mp4_itself(server):
    form = {"prompt": PROMPT, "size": "48x32", **FIELDS, "num_frames": 8, "flow_shift": 3.0}
    reply = httpx.post(f"{server.url}/v1/videos/sync", data=form, timeout=120)
    assert reply.status_code == 200 and reply.headers["content-type"] == "video/mp4"
    assert reply.headers["X-Num-Frames"] == "9"  # 8 frames asked: 9 on the grid
    frames, fps = read_mp4(reply.content)
    assert frames.shape == (9, 32, 48, 3) and fps == 8
    shifted = httpx.post(
        f"{server.url}/v1/videos/sync", data={**form, "flow_shift": 7.0}, timeout=120
    )
    assert float(np.abs(read_mp4(shifted.content)[0].astype(int) - frames).mean()) > 1


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
        # past the tiny transformer's rotary table (32 patches a side: 512 pixels)
        ({"size": "1024x16", "num_frames": "5"}, "width"),
        ({"size": "16x4096", "num_frames": "5"}, "height"),
        ({"num_frames": "84"}, "num_frames"),  # 85 on the grid: more than Wan 2.1's 81
        ({"fps": "0"}, "fps"),
        ({"fps": "500"}, "fps"),
        ({"num_inference_steps": "0"}, "num_inference_steps"),
        ({"seconds": "6"}, "seconds"),  # 96 frames at 16 fps: more than 81
        ({"seconds": "1", "num_frames": "9"}, "seconds"),
        ({"guidance_scale_2": "3"}, "guidance_scale_2"),  # Wan 2.2's: not this folder's
        ({"boundary_ratio": "0.5"}, "boundary_ratio"),
        ({"guidance_scale": "1e38"}, "guidance_scale"),
        ({"response_format": "url"}, "response_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_before_a_job_starts(server, fields, field):
    form = {"prompt": PROMPT, "size": "48x32", **fields}
    for route in ("/v1/videos", "/v1/videos/sync"):
        files = {k: (None, v) for k, v in form.items()}
        reply = httpx.post(f"{server.url}{route}", files=files)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == field, reply.text


def test_unknown_jobs_are_404(server):
    for method, path in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
        reply = httpx.request(method, f"{server.url}/v1/videos/video_nope{path}")
        assert reply.status_code == 404 and "not found" in reply.text.lower(), reply.text


def test_an_uploaded_file_is_a_400_naming_it(server):
    files = {"prompt": (None, PROMPT), "input_reference": ("cat.png", b"\x89PNG", "image/png")}
    reply = httpx.post(f"{server.url}/v1/videos", files=files)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_reference"
