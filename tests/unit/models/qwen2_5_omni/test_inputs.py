"""Qwen2.5-Omni's prompt processor against transformers' ``Qwen2_5OmniProcessor`` (expanded ids,
each item's data) and the thinker's ``get_rope_index`` (positions, delta), on the tiny
checkpoint; and what it refuses.

transformers' video processor needs torchvision, which is not installed here: the reference
processor then gets a stand-in video processor running our ``video_pixels`` (so its own
placeholder expansion and audio interleaving are still what is compared), and our video
pixels are compared with ``Qwen2VLImageProcessorPil``'s pixels of the same frames (equal up to
the fused rescale-normalise's rounding, below). Where torchvision is importable, the real
``Qwen2VLVideoProcessor`` is the reference and the pixels must be bit-equal (checked so,
with torchvision 0.28 on an unmodified transformers 5.24, for resized and unresized frames,
odd frame counts and fps 1.3 / 2 / 3).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.models.media import Audio, MediaItem, Video
from omnistage.models.qwen2_5_omni import FAMILY
from omnistage.models.qwen2_5_omni.inputs import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from omnistage.models.qwen2_5_omni.rope_index import chunk_bounds
from tests.qwen2_5_omni_media import (
    CASES,
    HAS_TORCHVISION,
    build,
    frames,
    hf_process,
    hf_processor,
    noise_audio,
    picture,
)
from tests.qwen2_5_omni_reference import load_model


@pytest.fixture(scope="module")
def folder(tiny_qwen2_5_omni_folder):
    return tiny_qwen2_5_omni_folder


@pytest.fixture(scope="module")
def hf(folder):
    return hf_processor(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return FAMILY.prompt_processor(folder)


@pytest.fixture(scope="module")
def tokenizer(folder):
    from omnistage.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_prompt_and_items_equal_transformers_processor(case, hf, ours, tokenizer):
    messages, media, options, kw = build(case)
    text, ref = hf_process(hf, messages, options, kw)
    ids = tokenizer.encode_chat(messages)
    assert ids == hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = ours.process(ids, media, options)
    assert out.token_ids == ref["input_ids"][0].tolist()
    audio_rows = iter(range(len(kw["audio"])))
    images, image_rows = iter(ref.get("image_grid_thw", [])), 0
    for item, medium in zip(out.items, media, strict=True):
        run = out.token_ids[item.offset : item.offset + item.length]
        assert item.modality == medium.modality and item.content_hash
        placeholders = set(ours.placeholder_ids.values())
        assert set(run) <= placeholders
        assert out.token_ids[item.offset - 1] not in placeholders
        assert out.token_ids[item.offset + item.length] not in placeholders
        data = item.data
        if item.modality in ("audio", "video") and "input_features" in data:
            row = next(audio_rows)
            mask = ref["feature_attention_mask"][row].bool()
            assert torch.equal(data["input_features"], ref["input_features"][row][:, mask])
        if item.modality == "image":
            grid = next(images)
            patches = int(grid.prod())
            assert torch.equal(data["image_grid_thw"][0], grid)
            assert torch.equal(
                data["pixel_values"], ref["pixel_values"][image_rows : image_rows + patches]
            )
            image_rows += patches
        if item.modality == "video":
            assert torch.equal(data["video_grid_thw"], ref["video_grid_thw"])
            assert torch.equal(data["pixel_values_videos"], ref["pixel_values_videos"])
            if options.get("use_audio_in_video"):
                assert data["is_video"].tolist() == [
                    t == ours.placeholder_ids["video"] for t in run
                ]
    # The items' runs are every placeholder of the prompt.
    covered = sum(item.length for item in out.items)
    assert covered == sum(t in set(ours.placeholder_ids.values()) for t in out.token_ids)


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_equal_transformers_get_rope_index(case, folder, hf, ours, tokenizer):
    messages, media, options, kw = build(case)
    _, ref = hf_process(hf, messages, options, kw)
    out = ours.process(tokenizer.encode_chat(messages), media, options)
    thinker = load_model(str(folder)).thinker.model
    mask = ref.get("feature_attention_mask")
    positions, delta = thinker.get_rope_index(
        ref["input_ids"],
        ref.get("image_grid_thw"),
        ref.get("video_grid_thw"),
        ref["attention_mask"],
        bool(options.get("use_audio_in_video")),
        None if mask is None else mask.sum(-1),
        ref.get("video_second_per_grid"),
    )
    assert out.positions.dtype == torch.long
    assert torch.equal(out.positions, positions[:, 0])
    assert out.position_delta == int(delta)
    if case == "audio":  # transformers' 1-D branch: no grid, plain positions even for audio
        assert torch.equal(out.positions, torch.arange(len(out.token_ids)).expand(3, -1))


def test_video_pixels_are_the_image_processors_for_frames_needing_no_resize(hf, ours):
    """The same pixels, frame by frame, as the PIL image processor makes of each frame (which
    repeats a picture over the temporal patch), up to rounding: the video processor (and
    ``video_pixels``) rescales and normalises in one float32 step, ``(x - 255 mean) / (255
    std)``, the image processor in two (``x / 255``, then ``(y - mean) / std``): at most a
    few float32 ulps apart (|pixel| < 2.2, so within 2e-6)."""
    clip = frames(3, 252, 420, seed=3)  # 252 x 420: a multiple of 28, within the bounds
    item = ours.process(
        [ours.vision_bos, ours.placeholder_ids["video"], ours.vision_eos],
        [MediaItem("video", Video(clip, 2.0), "v")],
        {},
    ).items[0]
    grid = item.data["video_grid_thw"][0].tolist()
    assert grid == [2, 18, 30]  # 3 frames padded to 4 with the last one
    pixels = item.data["pixel_values_videos"].view(2, 18 * 30, 3, 2, 14, 14)
    padded = [*clip, clip[-1]]
    for t in range(2):
        for slot in range(2):
            image = Image.fromarray(padded[2 * t + slot])
            ref = ours.images(
                images=[image],
                size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
                return_tensors="pt",
            )
            assert ref["image_grid_thw"][0].tolist() == [1, 18, 30]
            ref_pixels = ref["pixel_values"].view(18 * 30, 3, 2, 14, 14)[:, :, 0]
            torch.testing.assert_close(pixels[t, :, :, slot], ref_pixels, rtol=0, atol=2e-6)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' video processor needs torchvision")
def test_video_pixels_equal_the_torchvision_video_processor(hf, ours):
    for shape in [(4, 252, 420), (5, 260, 350), (3, 500, 700)]:
        clip = frames(*shape)
        ref = hf.video_processor(
            videos=[clip],
            size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
            return_tensors="pt",
        )
        item = ours.video(Video(clip, 2.0), ours.options({}), "v")
        assert torch.equal(item.data["pixel_values_videos"], ref["pixel_values_videos"])


def test_options_change_what_transformers_changes(hf, ours, tokenizer):
    messages, media, _, kw = build("audio_image")
    for options in ({"min_pixels": 20000, "max_pixels": 30000}, {"max_pixels": 3136}):
        _, ref = hf_process(hf, messages, options, kw)
        out = ours.process(tokenizer.encode_chat(messages), media, options)
        assert out.token_ids == ref["input_ids"][0].tolist()
    plain = ours.process(tokenizer.encode_chat(messages), media, {})
    assert [i.content_hash for i in plain.items] == ["a0", "i1", "i2"]
    assert out.items[0].content_hash == "a0"  # audio is not changed by pixel bounds
    assert out.items[1].content_hash not in ("i1", plain.items[1].content_hash)


def test_fps_sets_the_time_between_temporal_patches(ours, folder, tokenizer):
    messages, media, options, _ = build("video_audio")
    ids = tokenizer.encode_chat(messages)
    native = ours.process(ids, media, options)  # the video's own 1.5 fps
    faster = ours.process(ids, media, {**options, "fps": 4.0})
    assert not torch.equal(faster.positions, native.positions)
    assert faster.token_ids != native.token_ids  # other chunks: another interleaving
    assert faster.items[1].content_hash != native.items[1].content_hash
    same = ours.process(ids, media, {**options, "fps": 1.5})
    assert torch.equal(same.positions, native.positions)


def test_chunks_split_once_per_value_that_crosses(ours):
    assert chunk_bounds([0, 0, 25, 25, 50, 50, 75], 50) == [(0, 4), (4, 7)]
    assert chunk_bounds([0, 0, 150, 150], 50) == [(0, 2), (2, 3), (3, 4)]  # transformers' too
    assert chunk_bounds([], 50) == [(0, 0)]


def test_audio_is_resampled_to_16_khz(ours, hf):
    import soxr

    samples = noise_audio(1.1, rate=22050)
    item = ours.audio_features(Audio(samples, 22050), "x")
    resampled = soxr.resample(samples, 22050, 16000)
    ref = hf.feature_extractor(
        resampled,
        sampling_rate=16000,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    frames_ = int(ref["attention_mask"].sum())
    assert torch.equal(item, ref["input_features"][0, :, :frames_])


def prompt(ours, *modalities):
    framing = {"audio": (ours.audio_bos, ours.audio_eos)}
    ids = [100]  # text (the special tokens are the first ids)
    for m in modalities:
        bos, eos = framing.get(m, (ours.vision_bos, ours.vision_eos))
        ids += [bos, ours.placeholder_ids[m], eos]
    return ids + [101]


@pytest.mark.parametrize(
    "ids_of, media, options, field",
    [
        (("audio",), [], {}, "multi_modal_data"),
        (("audio",), [("image", (50, 50))], {}, "multi_modal_data[0]"),
        (("audio",), [("audio", 0.01)], {}, "multi_modal_data[0]"),  # 160 samples: 1 frame
        (("image",), [("image", (1, 300))], {}, "multi_modal_data[0]"),  # aspect ratio 300
        (("video",), [("video_silent",)], {"use_audio_in_video": True}, "multi_modal_data[0]"),
        (("image",), [("image", (50, 50))], {"detail": "high"}, "mm_processor_kwargs.detail"),
        (
            ("image",),
            [("image", (50, 50))],
            {"max_pixels": 10**9},
            "mm_processor_kwargs.max_pixels",
        ),
        (
            ("image",),
            [("image", (50, 50))],
            {"min_pixels": 40000, "max_pixels": 30000},
            "mm_processor_kwargs.min_pixels",
        ),
        (("video",), [("video_silent",)], {"fps": 0}, "mm_processor_kwargs.fps"),
        (
            ("video",),
            [("video_silent",)],
            {"use_audio_in_video": "yes"},
            "mm_processor_kwargs.use_audio_in_video",
        ),
    ],
)
def test_bad_input_is_an_invalid_request_naming_the_field(ours, ids_of, media, options, field):
    items = []
    for spec in media:
        if spec[0] == "audio":
            items.append(MediaItem("audio", Audio(noise_audio(spec[1]), 16000)))
        elif spec[0] == "image":
            items.append(MediaItem("image", picture(*spec[1])))
        else:
            items.append(MediaItem("video", Video(frames(2, 56, 56), 2.0)))
    with pytest.raises(InvalidRequestError) as err:
        ours.process(prompt(ours, *ids_of), items, options)
    assert err.value.field == field


def test_a_placeholder_outside_its_framing_is_refused(ours):
    image = MediaItem("image", picture(50, 50))
    with pytest.raises(InvalidRequestError, match="start and end tokens"):
        ours.process([100, ours.placeholder_ids["image"], 101], [image], {})


def test_the_chat_template_renders_media_parts_as_placeholders(tokenizer, ours):
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "x"}, {"type": "audio"}],
        }
    ]
    ids = tokenizer.encode_chat(messages)
    runs = [ids[i - 1 : i + 2] for i, t in enumerate(ids) if t in ours.placeholder_ids.values()]
    video, audio = ours.placeholder_ids["video"], ours.placeholder_ids["audio"]
    assert runs == [
        [ours.vision_bos, video, ours.vision_eos],
        [ours.audio_bos, audio, ours.audio_eos],
    ]
    text_only = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert text_only.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


@pytest.mark.parametrize(
    "item",
    [
        MediaItem("image", Image.new("RGB", (0, 5))),
        MediaItem("image", "not a picture"),  # type: ignore[arg-type]
        MediaItem("image", Image.new("RGB", (4, 4), color=(9, 9, 9)).convert("CMYK")),
    ],
)
def test_every_image_is_processed_or_refused_by_field(ours, item):
    ids = prompt(ours, "image")
    try:
        out = ours.process(ids, [item], {})
    except InvalidRequestError as err:
        assert err.field == "multi_modal_data[0]"
    else:  # a tiny picture is scaled up to min_pixels, as transformers does
        assert out.items[0].data["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("seconds", [0.03, 0.5, 7.3, 29.9, 31.5])
@pytest.mark.parametrize("kind", ["noise", "silence"])
def test_audio_features_padded_to_their_reach_equal_the_full_window(ours, seconds, kind):
    """The processor pads to the extractor's whole window; ours pads to the last frame's reach
    only (a fraction of the cost): the same frames, bit for bit, silence included."""
    n = int(seconds * 16000)
    samples = noise_audio(seconds) if kind == "noise" else np.zeros(n, np.float32)
    full = ours.features(
        samples, sampling_rate=16000, padding="max_length", return_attention_mask=True,
        return_tensors="pt",
    )  # fmt: skip
    frames = int(full["attention_mask"].sum())
    got = ours.audio_features(Audio(samples, 16000), "x")
    assert torch.equal(got, full["input_features"][0, :, :frames])


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("seconds", [0.05, 0.5, 1.37, 7.0, 31.0])
def test_min_tokens_never_counts_more_than_the_audio_expands_to(ours, rate, seconds):
    """The bound that refuses an audio too long for the context before it is featurized."""
    from tests.qwen2_5_omni_media import audio_tokens_and_bound

    count, least = audio_tokens_and_bound(ours, rate, seconds)
    assert count - 2 <= least <= count, (least, count)  # close: it refuses what surely won't fit
