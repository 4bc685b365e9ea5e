import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.diffusion.params import (
    DiffusionParams,
    DiffusionRequest,
    PipelineLimits,
    validate_request,
)

TEXT = PipelineLimits(size_multiple=8, embedding_dim=256, has_text_encoder=True)
EMBEDS_ONLY = PipelineLimits(size_multiple=8, embedding_dim=256, has_text_encoder=False)


def check(field: str, limits: PipelineLimits = TEXT, **request_kwargs) -> None:
    request_kwargs.setdefault("prompt", "a cat")
    with pytest.raises(InvalidRequestError) as info:
        validate_request(DiffusionRequest("r", **request_kwargs), limits)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("height", DiffusionParams(height=60)),
        ("height", DiffusionParams(height=0)),
        ("width", DiffusionParams(width=65)),
        ("num_inference_steps", DiffusionParams(num_inference_steps=0)),
        ("num_inference_steps", DiffusionParams(num_inference_steps=1001)),
        ("guidance_scale", DiffusionParams(guidance_scale=float("nan"))),
        ("guidance_scale", DiffusionParams(guidance_scale=-1.0)),
        ("guidance_scale", DiffusionParams(guidance_scale=1e38)),  # via sampling_params_list
        ("seed", DiffusionParams(seed=-3)),
        ("scheduler", DiffusionParams(scheduler="euler_ancestral")),
        ("max_sequence_length", DiffusionParams(max_sequence_length=0)),
    ],
)
def test_bad_params_name_their_field(field, params):
    check(field, params=params)


def test_prompt_and_embeddings_are_exclusive():
    check("prompt", prompt="a cat", prompt_embeds=torch.zeros(3, 256))
    check("prompt", prompt=None)


def test_text_needs_a_text_encoder():
    check("prompt", limits=EMBEDS_ONLY)
    check(
        "negative_prompt",
        limits=EMBEDS_ONLY,
        prompt=None,
        prompt_embeds=torch.zeros(2, 256),
        params=DiffusionParams(guidance_scale=3.0, negative_prompt="blurry"),
    )


@pytest.mark.parametrize(
    "embeds",
    [
        torch.zeros(4, 128),
        torch.zeros(256),
        torch.zeros(2, 256, dtype=torch.long),
        torch.full((2, 256), float("inf")),
        torch.zeros(0, 256),
    ],
)
def test_bad_embeddings_are_rejected(embeds):
    check("prompt_embeds", limits=EMBEDS_ONLY, prompt=None, prompt_embeds=embeds)


def test_embedding_dim_mismatch_message_names_both_dims():
    with pytest.raises(InvalidRequestError, match="128.*256"):
        validate_request(DiffusionRequest("r", prompt_embeds=torch.zeros(4, 128)), EMBEDS_ONLY)


def test_valid_requests_pass():
    validate_request(
        DiffusionRequest("r", prompt="a cat", params=DiffusionParams(height=32, seed=3)), TEXT
    )
    validate_request(
        DiffusionRequest(
            "e",
            prompt_embeds=torch.randn(5, 256),
            negative_prompt_embeds=torch.zeros(1, 256),
            params=DiffusionParams(guidance_scale=4.0, scheduler="ddim"),
        ),
        EMBEDS_ONLY,
    )


def test_a_list_entry_out_of_range_is_named_under_the_entry():
    """vLLM-Omni's sampling_params_list: guidance_scale=1e38 in an entry was a 200 with an
    all-black picture; each value is checked where it was given."""
    from omnistage.config import StageConfig
    from omnistage.engine.stage_params import params_by_field
    from omnistage.stage.diffusion.request_preparer import DiffusionRequestPreparer
    from omnistage.stage.diffusion.wire import DiffusionStageInfo

    limits = PipelineLimits(size_multiple=16, embedding_dim=8, has_text_encoder=True)
    preparer = DiffusionRequestPreparer(StageConfig.model_construct(), DiffusionStageInfo(limits))
    for entry, field in [
        ({"guidance_scale": 1e38}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"height": 17}, "height"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            params_by_field([entry], [preparer])
        assert info.value.field == f"sampling_params_list.0.{field}"
    # a value that is fine alone passes: the merged parameters are checked as a whole later
    assert params_by_field([{"height": 1024, "guidance_scale": 3.5}], [preparer])
