"""The video route's request: form strings become typed fields, and contradictions are refused
naming the field; a video's frames follow the family's grid and its rate (``video_frames``)."""

import pytest

from omnistage.entrypoints.openai.serving_videos import VideoGenerationRequest
from omnistage.errors import InvalidRequestError
from omnistage.stage.diffusion.params import (
    DiffusionParams,
    PipelineLimits,
    validate_params,
    video_frames,
)

WAN = PipelineLimits(
    size_multiple=16, embedding_dim=8, has_text_encoder=True, max_frames=81, frame_step=4,
    default_frames=81, default_fps=16, family="WanPipeline",
)  # fmt: skip


def test_form_strings_become_the_stage_parameters():
    form = {"prompt": "a cat", "size": "48x32", "num_frames": "9", "fps": "8", "seed": "5"}
    form |= {"flow_shift": "3.0", "guidance_scale_2": "1"}
    params = VideoGenerationRequest.model_validate(form).image_params()
    assert params == {
        "video": True, "width": 48, "height": 32, "num_frames": 9, "fps": 8, "seed": 5,
        "flow_shift": 3.0, "guidance_scale_2": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "frames"),
    [
        ({"num_frames": 8}, 9),  # vLLM-Omni's rounding: (n // 4) * 4 + 1
        ({"num_frames": 81}, 81),
        ({"num_frames": 80}, 81),
        ({"seconds": 4}, 65),  # 4 s at the family's 16 fps, on the grid
        ({"seconds": 2, "fps": 8}, 17),
        ({}, 81),
    ],
)
def test_frames_are_rounded_to_the_familys_grid(fields, frames):
    params = DiffusionParams(video=True, **fields)
    validate_params(params, WAN)
    assert video_frames(params, WAN) == frames


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"seconds": 2, "num_frames": 9}, "seconds"),
        ({"seconds": 6}, "seconds"),  # 96 frames: more than the family's 81
        ({"num_frames": 84}, "num_frames"),  # 85 on the grid
        ({"flow_shift": 3.0}, "flow_shift"),  # this scheduler has none
    ],
)
def test_stage_refuses_what_the_family_cannot_make(fields, named):
    with pytest.raises(InvalidRequestError) as info:
        validate_params(DiffusionParams(video=True, **fields), WAN)
    assert info.value.field == named and (named != "flow_shift" or "WanPipeline" in str(info.value))


def test_size_and_width_that_disagree_are_refused_naming_size():
    with pytest.raises(InvalidRequestError) as info:
        VideoGenerationRequest(prompt="a cat", size="48x32", width=64).image_params()
    assert info.value.field == "size"


def test_a_side_past_the_familys_positions_is_a_400_naming_it():
    """SD3's position embedding covers pos_embed_max_size patches a side: past it, diffusers'
    own model raises (a 500 once); here it is refused before any stage runs."""
    limits = PipelineLimits(size_multiple=4, embedding_dim=8, has_text_encoder=True, max_side=128)
    with pytest.raises(InvalidRequestError, match="positions reach 128") as info:
        validate_params(DiffusionParams(height=1024, width=128), limits)
    assert info.value.field == "height"
    validate_params(DiffusionParams(height=128, width=128), limits)
