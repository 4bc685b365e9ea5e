"""vLLM's ``multi_modal_data`` of a Python prompt as media items
(``omnistage.models.media.media_items``): every accepted shape, the order, the content hashes,
and every refusal with the item it names."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.models.media import DEFAULT_VIDEO_FPS, Audio, Video, media_items

RATE = 16000


def tone(seconds: float = 1.0, rate: int = RATE, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def test_multi_modal_data_becomes_items_in_modality_order():
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    pil = Image.new("RGB", (8, 6), (1, 2, 3))
    items = media_items(
        {
            "video": [frames, ([pil, pil], {"fps": 4})],
            "image": pil.convert("L"),
            "audio": [(tone(), RATE), ((tone(channels=2) * 32767).astype(np.int16), 8000)],
        }
    )
    assert [i.modality for i in items] == ["audio", "audio", "image", "video", "video"]
    first, second = items[0].value, items[1].value
    assert isinstance(first, Audio) and isinstance(second, Audio)
    assert second.sampling_rate == 8000 and second.samples.ndim == 1
    np.testing.assert_allclose(second.samples, tone(), atol=1e-3)
    image = items[2].value
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    video, pil_video = items[3].value, items[4].value
    assert isinstance(video, Video) and video.fps == 2.0 and video.frames.shape == (3, 8, 8, 3)
    assert isinstance(pil_video, Video) and pil_video.fps == 4.0
    assert pil_video.frames.shape == (2, 6, 8, 3)
    assert len({i.content_hash for i in items}) == 5
    again = media_items({"audio": (tone(), RATE), "image": [pil, pil]})
    assert again[0].content_hash == items[0].content_hash
    assert again[1].content_hash == again[2].content_hash
    assert media_items({"image": []}) == []


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ("audio", "multi_modal_data", "mapping"),
        ({"speech": []}, "multi_modal_data.speech", "unknown modality"),
        ({"audio": tone()}, "multi_modal_data.audio", "list"),
        ({"audio": [tone()]}, "multi_modal_data.audio[0]", "(samples, sampling_rate)"),
        ({"audio": (tone(), 0)}, "multi_modal_data.audio", "sampling rate"),
        ({"audio": [(tone(), 1.5)]}, "multi_modal_data.audio[0]", "sampling rate"),
        ({"audio": (["a"], RATE)}, "multi_modal_data.audio", "numpy array"),
        ({"audio": (np.zeros((2, 3, 4)), RATE)}, "multi_modal_data.audio", "1-D"),
        ({"audio": (np.zeros((100, 100)), RATE)}, "multi_modal_data.audio", "shape"),
        ({"audio": (np.array([np.nan]), RATE)}, "multi_modal_data.audio", "finite"),
        ({"image": ["x.png"]}, "multi_modal_data.image[0]", "PIL image"),
        ({"image": np.zeros((4, 4), np.uint8)}, "multi_modal_data.image", "[H, W, 3] uint8"),
        ({"video": np.zeros((2, 4, 4, 3))}, "multi_modal_data.video", "uint8"),
        ({"video": [np.zeros((0, 4, 4, 3), np.uint8)]}, "multi_modal_data.video[0]", "T >= 1"),
        (
            {"video": (np.zeros((1, 4, 4, 3), np.uint8), {"fps": -1})},
            "multi_modal_data.video.fps",
            "positive",
        ),
    ],
)
def test_bad_multi_modal_data_is_refused_naming_the_item(data, field, message):
    with pytest.raises(InvalidRequestError) as info:
        media_items(data)
    assert info.value.field == field and message in str(info.value)


def test_pcm_integers_are_scaled_from_their_full_range():
    (signed,) = media_items({"audio": (np.array([-32768, 0, 16384], np.int16), RATE)})
    (unsigned,) = media_items({"audio": (np.array([0, 128, 192], np.uint8), RATE)})
    for item in (signed, unsigned):
        assert isinstance(item.value, Audio) and item.value.samples.dtype == np.float32
        np.testing.assert_allclose(item.value.samples, [-1.0, 0.0, 0.5])
    (stereo,) = media_items({"audio": (np.stack([tone(), tone()]), np.int32(RATE))})
    assert isinstance(stereo.value, Audio) and stereo.value.sampling_rate == RATE
    np.testing.assert_allclose(stereo.value.samples, tone(), atol=1e-6)  # [channels, frames]


def test_a_video_may_give_its_fps_as_metadata_or_as_a_number():
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    as_metadata, as_number, as_int, default = media_items(
        {"video": [(frames, {"fps": 4.0}), (frames, 4.0), (frames, 4), frames]}
    )
    for item in (as_metadata, as_number, as_int):
        assert isinstance(item.value, Video) and item.value.fps == 4.0
        assert item.options == {"fps": 4.0} and item.content_hash == as_metadata.content_hash
    assert isinstance(default.value, Video) and default.value.fps == DEFAULT_VIDEO_FPS
    assert default.content_hash != as_number.content_hash
    (single,) = media_items({"video": (frames, 1.5)})
    assert isinstance(single.value, Video) and single.value.fps == 1.5


def test_a_transparent_image_lies_on_white_and_an_array_is_an_image():
    clear = Image.new("RGBA", (4, 3), (200, 30, 60, 0))
    as_pil, as_array = media_items({"image": [clear, np.full((3, 4, 3), 255, np.uint8)]})
    assert isinstance(as_pil.value, Image.Image) and as_pil.value.mode == "RGB"
    assert tuple(np.asarray(as_pil.value)[0, 0]) == (255, 255, 255)
    assert as_pil.content_hash == as_array.content_hash  # the same pixels


@pytest.mark.parametrize(
    ("video", "field", "message"),
    [
        ((np.zeros((1, 4, 4, 3), np.uint8), 0), "multi_modal_data.video.fps", "positive"),
        (
            (np.zeros((1, 4, 4, 3), np.uint8), float("inf")),
            "multi_modal_data.video.fps",
            "positive",
        ),
        ((np.zeros((1, 4, 4, 3), np.uint8), True), "multi_modal_data.video.fps", "positive"),
        ((np.zeros((1, 4, 4, 3), np.uint8), "2"), "multi_modal_data.video", "(frames, fps)"),
        ((np.zeros((1, 4, 4, 3), np.uint8), 2, 3), "multi_modal_data.video", "(frames, fps)"),
    ],
)
def test_bad_video_rates_are_refused_naming_them(video, field, message):
    with pytest.raises(InvalidRequestError) as info:
        media_items({"video": video})
    assert info.value.field == field and message in str(info.value)
