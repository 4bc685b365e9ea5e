"""The diffusion part of ``omnistage.stage.requests``: wire dicts -> ``DiffusionRequest``."""

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.stage.diffusion.params import DiffusionParams
from omnistage.stage.requests import diffusion_request_builder

build = diffusion_request_builder(engine=None)


def test_params_and_top_level_negative_prompt_are_taken():
    request = build("r", {"prompt": "a cat", "negative_prompt": "blur", "params": {"seed": 3}})
    assert request.params == DiffusionParams(seed=3, negative_prompt="blur")


@pytest.mark.parametrize("params", ["seed=3", 5, [1, 2], ["ab"]])
def test_params_that_are_not_an_object_name_the_field(params):
    with pytest.raises(InvalidRequestError) as info:
        build("r", {"prompt": "a cat", "params": params})
    assert info.value.field == "params"
