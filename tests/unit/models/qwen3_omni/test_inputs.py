"""Qwen3-Omni's prompt processor against transformers' ``Qwen3OmniMoeProcessor`` (expanded ids,
each item's data: audio padded to the prompt's longest, as the processor batches it) and the
thinker's ``get_rope_index`` (positions, delta), on the tiny checkpoint; and what it refuses.
Video prompts: tests/unit/models/qwen3_omni/test_video.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.media import Audio, MediaItem, Video
from omnistage.models.qwen3_omni.encoders import audio_output_length
from omnistage.models.qwen3_omni.inputs import Qwen3OmniPromptProcessor
from omnistage.models.tokenizer import Tokenizer
from tests.unit.models.qwen3_omni.thinker_helpers import (
    CASES,
    hf_inputs,
    hf_processor,
    hf_thinker,
    media_of,
    messages_of,
    noise,
    picture,
    tiny_folder,
)


@pytest.fixture(scope="module")
def folder():
    return tiny_folder()


@pytest.fixture(scope="module")
def ours(folder):
    return Qwen3OmniPromptProcessor(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return hf_processor(folder)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def thinker(folder):
    return hf_thinker(folder).model


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_prompt_items_and_positions_equal_transformers(case, ours, hf, tokenizer, thinker):
    ref = hf_inputs(hf, case)
    ids = tokenizer.encode_chat(messages_of(case))
    out = ours.process(ids, media_of(case), {})
    assert out.token_ids == ref["input_ids"][0].tolist()
    placeholders = set(ours.placeholder_ids.values())
    audio_row, image_row, grids = 0, 0, iter(ref.get("image_grid_thw", []))
    for item in out.items:
        run = out.token_ids[item.offset : item.offset + item.length]
        assert set(run) == {ours.placeholder_ids[item.modality]} and item.content_hash
        assert out.token_ids[item.offset - 1] not in placeholders
        assert out.token_ids[item.offset + item.length] not in placeholders
        if item.modality == "audio":
            mask = ref["feature_attention_mask"][audio_row].bool()
            assert torch.equal(
                item.data["input_features"], ref["input_features"][audio_row][:, mask]
            )
            assert item.length == audio_output_length(int(mask.sum()), 50)
            audio_row += 1
        else:
            grid = next(grids)
            patches = int(grid.prod())
            assert torch.equal(item.data["image_grid_thw"][0], grid)
            assert torch.equal(
                item.data["pixel_values"], ref["pixel_values"][image_row : image_row + patches]
            )
            image_row += patches
    mask = ref.get("feature_attention_mask")
    positions, delta = thinker.get_rope_index(
        ref["input_ids"],
        ref.get("image_grid_thw"),
        None,
        ref["attention_mask"],
        False,
        None if mask is None else mask.sum(-1),
        None,
    )
    assert out.positions is not None and out.positions.dtype == torch.long
    assert torch.equal(out.positions, positions[:, 0].long())
    assert torch.equal(positions[:, 0], positions[:, 0].round())  # whole numbers in float32
    assert out.position_delta == int(delta)


def test_audio_padding_follows_the_prompts_longest_and_its_hash(ours, tokenizer):
    short, long_ = noise(41650, 0), noise(60000, 1)
    ids = tokenizer.encode_chat(
        [{"role": "user", "content": [{"type": "audio", "audio": a} for a in (short, long_)]}]
    )
    alone = ours.process(
        tokenizer.encode_chat([{"role": "user", "content": [{"type": "audio", "audio": short}]}]),
        [MediaItem("audio", Audio(short, 16000), "s")],
        {},
    ).items[0]
    both = ours.process(
        ids,
        [
            MediaItem("audio", Audio(short, 16000), "s"),
            MediaItem("audio", Audio(long_, 16000), "l"),
        ],
        {},
    ).items
    # Padded among a longer one, the clip has one frame more (transformers' batching).
    assert both[0].data["input_features"].shape[1] == alone.data["input_features"].shape[1] + 1
    assert both[0].content_hash != alone.content_hash and both[1].content_hash == "l"


@pytest.mark.parametrize(
    "media, options, field",
    [
        ([], {}, "multi_modal_data"),  # a placeholder without its medium
        ([("image", picture(64, 64, 0))], {}, "multi_modal_data[0]"),  # audio's placeholder
        ([("video", None)], {}, "multi_modal_data[0]"),  # a video at audio's placeholder
        ([("audio", noise(100, 0))], {}, "multi_modal_data[0]"),  # under one frame
        ([("audio", noise(16000, 0))], {"use_audio_in_video": 1}, "mm_processor_kwargs"),
        ([("audio", noise(16000, 0))], {"fps": -2}, "mm_processor_kwargs.fps"),
        ([("audio", noise(16000, 0))], {"max_pixels": 10}, "mm_processor_kwargs.max_pixels"),
    ],
)
def test_what_is_refused_names_its_field(ours, tokenizer, media, options, field):
    ids = tokenizer.encode_chat(
        [{"role": "user", "content": [{"type": "audio", "audio": noise(10, 0)}]}]
    )
    items = []
    for kind, value in media:
        if kind == "audio":
            value = Audio(value, 16000)
        elif kind == "video":
            value = Video(np.zeros((2, 32, 32, 3), np.uint8), 2.0)
        items.append(MediaItem(kind, value, "x"))
    with pytest.raises(InvalidRequestError) as err:
        ours.process(ids, items, options)
    assert err.value.field.startswith(field)


def test_a_placeholder_outside_its_framing_is_refused(ours):
    audio = ours.placeholder_ids["audio"]
    with pytest.raises(InvalidRequestError, match="start and end tokens"):
        ours.process([100, audio, 101], [MediaItem("audio", Audio(noise(16000, 0), 16000))], {})


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("seconds", [0.05, 0.5, 1.37, 7.0, 31.0])
def test_min_tokens_never_counts_more_than_the_audio_expands_to(ours, rate, seconds):
    """The bound that refuses an audio too long for the context before it is featurized."""
    from tests.qwen2_5_omni_media import audio_tokens_and_bound

    count, least = audio_tokens_and_bound(ours, rate, seconds)
    assert count - 2 <= least <= count, (least, count)  # close: it refuses what surely won't fit
