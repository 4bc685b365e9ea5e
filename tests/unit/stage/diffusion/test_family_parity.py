"""Each real family's tiny preset, saved by diffusers' own ``save_pretrained``: the stage's image
(or frames) for a seed equals diffusers' ``__call__`` for the same folder and generator draw —
alone, batched with three other requests, and after every component slept at level 1 and 2."""

import numpy as np
import pytest
import torch

from omnistage.stage.diffusion.engine import DiffusionStageEngine
from omnistage.stage.diffusion.params import MAX_FPS, DiffusionParams, DiffusionRequest
from tests.unit.stage.diffusion.conftest import diffusion_config, run_all
from tests.unit.stage.diffusion.family_cases import CASES, preset_folder

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request):
    """(case, diffusers pipeline, our engine) for one preset; one of each per module."""
    case = CASES[request.param]
    folder = preset_folder(request.param)
    reference = case.load_reference(folder)
    engine = DiffusionStageEngine(diffusion_config(folder, max_batch_size=4))
    yield case, reference, engine
    engine.shutdown()


def pixels(engine, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
    outputs = run_all(engine, requests)
    for output in outputs.values():
        assert output.finish_reason == "stop", output.error
    return {rid: out.media[0].pixels.numpy() for rid, out in outputs.items()}


def request(case, rid: str, seed: int, prompt: str | None = None, **fields) -> DiffusionRequest:
    params = DiffusionParams(**{**case.params, "seed": seed, "return_pixels": True, **fields})
    return DiffusionRequest(rid, prompt=prompt or case.prompt, params=params)


@pytest.fixture(scope="module")
def expected(served):
    case, reference, _ = served
    return case.reference_pixels(reference, seed=7)


def test_alone_equals_diffusers(served, expected):
    case, _, engine = served
    ours = pixels(engine, [request(case, "alone", 7)])["alone"]
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() <= case.tolerance


def test_batched_with_three_others_equals_alone(served, expected):
    case, _, engine = served
    others = [
        request(case, f"other-{i}", seed=100 + i, prompt=case.other_prompt(i), **case.vary(i))
        for i in range(3)
    ]
    got = pixels(engine, [request(case, "mine", 7), *others])
    assert engine.last_batch_size == 4
    assert np.abs(got["mine"] - expected).max() <= case.tolerance


@pytest.mark.parametrize("level", [1, 2])
def test_each_component_sleeps_and_wakes_bit_exact(served, level):
    case, _, engine = served
    before = pixels(engine, [request(case, "before", 11)])["before"]
    for tag in engine.arena.tags:
        other_tags = [t for t in engine.arena.tags if t != tag]
        ack = engine.sleep(level=level, tags=[tag])
        assert ack.status == "SUCCESS" and ack.metadata.tags == [tag]
        stats = engine.arena.stats()
        assert stats[tag].resident_bytes == 0
        assert all(stats[t].resident_bytes == stats[t].reserved_bytes for t in other_tags)
        wake = engine.wake_up(tags=[tag])
        assert wake.status == "SUCCESS"
        if level == 2:  # only the woken component was read back
            assert wake.metadata.restored_bytes == stats[tag].reserved_bytes
        after = pixels(engine, [request(case, f"after-{tag}", 11)])[f"after-{tag}"]
        assert np.array_equal(after, before), tag


def test_weights_names_every_component(served):
    _, _, engine = served
    ack = engine.sleep(level=1, tags=["weights"])
    assert sorted(ack.metadata.tags) == sorted(engine.arena.tags)
    assert engine.wake_up(tags=["weights"]).status == "SUCCESS"


def test_reference_draws_what_we_draw(served):
    """The comparison is meaningful: another seed gives another image."""
    case, reference, _ = served
    first = case.reference_pixels(reference, seed=7)
    assert not np.array_equal(first, case.reference_pixels(reference, seed=8))
    assert torch.get_num_threads() == 1


def bad_requests(case, limits) -> list[tuple[str, DiffusionRequest]]:
    """(the field a 400 must name, a request wrong only there) for the family's limits."""
    step = limits.size_multiple
    cases = [
        ("height", request(case, "r", 1, height=step + 1)),
        ("num_inference_steps", request(case, "r", 1, num_inference_steps=0)),
        # past the stage's pixel limit, or past the family's positions where they end first
        ("size", request(case, "r", 1, height=4096 // step * step, width=4096 // step * step))
        if limits.max_side >= 4096
        else ("height", request(case, "r", 1, height=limits.max_side + step)),
        ("max_sequence_length", request(case, "r", 1, max_sequence_length=10**6)),
    ]
    if not limits.takes_negative_prompt:
        cases.append(("negative_prompt", request(case, "r", 1, negative_prompt="blurry")))
    if not limits.takes_scheduler_override:
        cases.append(("scheduler", request(case, "r", 1, scheduler="ddim")))
    if limits.max_frames > 1:  # a video family: too many frames, a bad rate (a count off the
        # grid is rounded onto it, as vLLM-Omni rounds it: test_video_request.py)
        too_many = limits.max_frames + limits.frame_step
        cases.append(("num_frames", request(case, "r", 1, num_frames=too_many)))
        cases.append(("fps", request(case, "r", 1, fps=MAX_FPS + 1)))
    else:
        cases.append(("model", request(case, "r", 1, video=True)))
    if not limits.takes_prompt_embeds:
        embeds = torch.zeros(4, limits.embedding_dim)
        params = DiffusionParams(**case.params)
        cases.append(("prompt_embeds", DiffusionRequest("r", prompt_embeds=embeds, params=params)))
    return cases


def test_bad_input_is_refused_naming_the_field(served):
    from omnistage.errors import InvalidRequestError

    case, _, engine = served
    for field_name, bad in bad_requests(case, engine.limits):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(bad)
        assert err.value.field == field_name, err.value


def test_the_tallest_and_widest_sizes_it_allows_are_served(served):
    """Every size is served or refused naming it: a side at the family's reach (its positions',
    or 1024 where they are unbounded) beside the narrowest side runs. Wan's rotary table once
    failed past rope_max_seq_len patches a side with diffusers' error as a 500."""
    case, _, engine = served
    limits = engine.limits
    step, longest = limits.size_multiple, min(limits.max_side, 1024) // limits.size_multiple
    for height, width in ((longest * step, step), (step, longest * step)):
        got = pixels(
            engine, [request(case, "edge", 3, height=height, width=width, num_inference_steps=1)]
        )["edge"]
        assert got.shape[-3:-1] == (height, width) or got.shape[-2:] == (height, width), got.shape
