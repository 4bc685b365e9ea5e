"""The video route's request: form strings become typed fields, ``seconds`` becomes frames,
and contradictions are refused naming the field."""

import pytest

from omnistage.entrypoints.openai.serving_videos import VideoGenerationRequest
from omnistage.errors import InvalidRequestError


def test_form_strings_become_the_stage_parameters():
    form = {"prompt": "a cat", "size": "48x32", "num_frames": "9", "fps": "8", "seed": "5"}
    params = VideoGenerationRequest.model_validate(form).image_params()
    assert params == {
        "video": True,
        "width": 48,
        "height": 32,
        "num_frames": 9,
        "fps": 8,
        "seed": 5,
    }


def test_seconds_are_seconds_times_fps_plus_one_frames():
    request = VideoGenerationRequest(prompt="a cat", seconds=2, fps=4)
    assert request.image_params()["num_frames"] == 9


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"seconds": 2}, "seconds"),  # without fps
        ({"seconds": 2, "fps": 4, "num_frames": 9}, "seconds"),
        ({"size": "48x32", "width": 64}, "size"),
    ],
)
def test_contradictions_are_refused_naming_the_field(fields, named):
    with pytest.raises(InvalidRequestError) as info:
        VideoGenerationRequest(prompt="a cat", **fields).image_params()
    assert info.value.field == named
