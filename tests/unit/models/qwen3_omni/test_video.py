"""Qwen3-Omni's video input on the tiny checkpoint, against transformers: our prompt processor
against ``Qwen3OmniMoeProcessor`` (expanded ids with a video's audio track interleaved by
time, ``pixel_values_videos``, ``video_grid_thw``, the audio track's features padded with the
prompt's other audio) and the thinker's ``get_rope_index`` (positions, delta); our video
encoder against ``get_video_features`` / ``get_audio_features``; our thinker's greedy ids
against ``thinker.generate`` on the processor's outputs; and what is refused.

transformers' video processor needs torchvision, which is not installed here: the reference
processor gets a stand-in video processor running our ``video_pixels``
(tests/qwen3_omni_media.py), so the pixels are ours on both sides; everything else compared
(placeholder expansion, interleaving, ``video_second_per_grid``, audio features, positions)
is transformers' own. Our video pixels are checked against the image processor's in
tests/unit/models/qwen2_5_omni/test_inputs.py (and against torchvision's processor where it
loads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.media import Audio, MediaItem, Video, media_items
from omnistage.models.qwen3_omni.inputs import Qwen3OmniPromptProcessor
from omnistage.models.qwen3_omni.rope_index import time_order
from omnistage.models.tokenizer import Tokenizer
from tests.qwen3_omni_media import (
    SMALL_FRAMES,
    frames,
    hf_processor,
    messages,
    options,
    processor_outputs,
)
from tests.qwen3_omni_media import media_items as case_items
from tests.unit.models.qwen3_omni.thinker_helpers import greedy, hf_thinker, our_thinker

VIDEO_CASES = ("video", "video_audio", "video_bounds")
STEPS = 6


@pytest.fixture(scope="module")
def folder(tiny_qwen3_omni_folder) -> Path:
    return tiny_qwen3_omni_folder


@pytest.fixture(scope="module")
def ours(folder):
    return Qwen3OmniPromptProcessor(folder)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return hf_thinker(folder)


@pytest.fixture(scope="module")
def model(folder):
    return our_thinker(folder)


def process(ours, tokenizer, case: str, **changes):
    return ours.process(
        tokenizer.encode_chat(messages(case)), case_items(case), options(case) | changes
    )


def hf_positions(hf, ref: dict) -> tuple[torch.Tensor, torch.Tensor]:
    mask = ref.get("feature_attention_mask")
    positions, delta = hf.model.get_rope_index(
        ref["input_ids"],
        ref.get("image_grid_thw"),
        ref.get("video_grid_thw"),
        ref["attention_mask"],
        bool(ref.get("use_audio_in_video")),
        None if mask is None else mask.sum(-1),
        ref.get("video_second_per_grid"),
    )
    return positions[:, 0], delta


@pytest.mark.parametrize("case", VIDEO_CASES)
def test_the_prompt_items_and_positions_equal_transformers(case, folder, ours, tokenizer, hf):
    ref = processor_outputs(str(folder), case)
    out = process(ours, tokenizer, case)
    assert out.token_ids == ref["input_ids"][0].tolist()
    audio_rows = iter(range(len(ref.get("feature_attention_mask", []))))
    (video,) = [item for item in out.items if item.modality == "video"]
    for item in out.items:
        if "input_features" in item.data:  # an audio, or the video's audio track
            row = next(audio_rows)
            mask = ref["feature_attention_mask"][row].bool()
            assert torch.equal(item.data["input_features"], ref["input_features"][row][:, mask])
    assert torch.equal(video.data["video_grid_thw"], ref["video_grid_thw"])
    assert torch.equal(video.data["pixel_values_videos"], ref["pixel_values_videos"])
    run = out.token_ids[video.offset : video.offset + video.length]
    if options(case).get("use_audio_in_video"):
        assert video.data["is_video"].tolist() == [t == ours.placeholder_ids["video"] for t in run]
        audio_bos, vision_bos = ours.audio_bos, ours.vision_bos
        assert out.token_ids[video.offset - 2 : video.offset] == [vision_bos, audio_bos]
        assert run[0] == ours.placeholder_ids["video"] and ours.placeholder_ids["audio"] in run
    else:
        assert set(run) == {ours.placeholder_ids["video"]} and "is_video" not in video.data
    positions, delta = hf_positions(hf, ref)
    assert torch.equal(positions, positions.round())  # whole numbers in transformers' float32
    assert out.positions is not None and out.positions.dtype == torch.long
    assert torch.equal(out.positions, positions.long())
    assert out.position_delta == int(delta)


@torch.no_grad()
def test_video_items_encode_as_transformers_features(model, ours, tokenizer, hf):
    """A video's embeddings and DeepStack rows are the vision encoder's on its temporal grid;
    with its audio track, the audio tokens' rows are the audio encoder's (DeepStack rows zero
    there: transformers adds them at visual positions only)."""
    for case in ("video", "video_audio"):
        item = next(i for i in process(ours, tokenizer, case).items if i.modality == "video")
        got = model.encoders["video"](**item.data)
        ref = hf.model.get_video_features(
            item.data["pixel_values_videos"], item.data["video_grid_thw"]
        )
        video = torch.stack([ref.pooler_output[0], *(f[0] for f in ref.deepstack_features)])
        assert got.shape == (3, item.length, 64)  # embeddings + 2 DeepStack rows
        is_video = item.data.get("is_video", torch.ones(item.length, dtype=torch.bool))
        assert torch.equal(got[:, is_video], video)
        if case == "video_audio":
            features = item.data["input_features"]
            mask = torch.ones(1, features.shape[1], dtype=torch.long)
            audio = hf.model.get_audio_features(features[None], mask).last_hidden_state
            assert torch.equal(got[0, ~is_video], audio)
            assert not got[1:, ~is_video].any()


@pytest.mark.parametrize("case", VIDEO_CASES)
@torch.no_grad()
def test_greedy_ids_equal_transformers_generate(case, folder, model, ours, tokenizer, hf):
    ref = processor_outputs(str(folder), case)
    prompt = process(ours, tokenizer, case)
    hf.model.rope_deltas = None
    out = hf.generate(
        **ref,
        max_new_tokens=STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    mine, logits = greedy(model, prompt, STEPS)
    torch.testing.assert_close(logits, out.logits[0][0], rtol=0, atol=1e-5)
    assert mine == out.sequences[0, len(prompt.token_ids) :].tolist()


def test_fps_sets_the_time_between_temporal_patches(ours, tokenizer):
    native = process(ours, tokenizer, "video_audio")  # the video's own 2 fps: 13 ids a patch
    slower = process(ours, tokenizer, "video_audio", fps=1.0)  # 26 ids a patch
    assert not torch.equal(slower.positions, native.positions)
    assert slower.token_ids != native.token_ids  # another interleaving
    assert slower.items[1].content_hash != native.items[1].content_hash
    same = process(ours, tokenizer, "video_audio", fps=2.0)
    assert torch.equal(same.positions, native.positions) and same.token_ids == native.token_ids


def test_fractional_time_positions_are_refused_naming_the_rate(folder, ours, tokenizer, hf):
    """At 4 frames per second a two-frame patch spans 6.5 position ids: transformers keeps
    the halves (float positions), which our integer positions cannot hold."""
    hf_proc = hf_processor(str(folder))
    text = hf_proc.tokenizer.apply_chat_template(
        messages("video"), tokenize=False, add_generation_prompt=True
    )
    ref = dict(hf_proc(text=text, videos=[frames(5, 56, 56)], fps=4.0, return_tensors="pt"))
    positions, _ = hf_positions(hf, ref)
    assert not torch.equal(positions, positions.round())
    with pytest.raises(InvalidRequestError, match="6.5 position ids") as err:
        process(ours, tokenizer, "video", fps=4.0)
    assert err.value.field == "mm_processor_kwargs.fps"
    ids = tokenizer.encode_chat(messages("video"))
    at_three = [MediaItem("video", Video(frames(5, 56, 56), 3.0), "v")]
    with pytest.raises(InvalidRequestError, match="e.g. 2 or 1") as err:
        ours.process(ids, at_three, {})  # the video's own rate
    assert err.value.field == "multi_modal_data[0]"
    one_patch = [MediaItem("video", Video(frames(2, 56, 56), 3.0), "v")]
    assert ours.process(ids, one_patch, {}).positions is not None  # one patch: time 0 only


def test_vllms_video_data_comes_at_its_fps(ours, tokenizer):
    """``multi_modal_data`` ``(frames, {"fps": 2})``: two-frame patches 13 ids apart."""
    (item,) = media_items({"video": (frames(4, 56, 56), {"fps": 2.0})})
    out = ours.process(tokenizer.encode_chat(messages("video")), [item], SMALL_FRAMES)
    start = out.token_ids.index(ours.vision_bos) + 1
    times = out.positions[0, start : start + 8]
    assert (times - times[0]).tolist() == [0] * 4 + [13] * 4


@pytest.mark.parametrize(
    "video, opts, field, message",
    [
        (Video(frames(4, 56, 56), 2.0), {"use_audio_in_video": True}, "multi_modal_data[0]",
         "audio track"),
        (Video(np.zeros((4, 56, 56), np.uint8), 2.0), {}, "multi_modal_data[0]", "uint8"),
        (Video(frames(4, 56, 56), 2.0, Audio(np.zeros(10, np.float32), 16000)),
         {"use_audio_in_video": True}, "multi_modal_data[0].audio", "too short"),
        (Video(frames(4, 56, 56), 2.0), {"fps": 0}, "mm_processor_kwargs.fps", "positive"),
    ],
)  # fmt: skip
def test_bad_videos_are_refused_naming_the_field(ours, tokenizer, video, opts, field, message):
    ids = tokenizer.encode_chat(messages("video"))
    with pytest.raises(InvalidRequestError, match=message) as err:
        ours.process(ids, [MediaItem("video", video, "v")], opts)
    assert err.value.field == field


def test_time_order_puts_video_first_on_ties_and_the_rest_last():
    assert time_order([0, 0, 13, 13], [0, 1, 2]) == [True, True, False, False, False, True, True]
    assert time_order([0, 26], list(range(30))) == [True, *[False] * 26, True, *[False] * 4]
    assert time_order([0, 13], [0]) == [True, False, True]
