"""The code2wav preparer, in the API process: checks against the limits the stage reported."""

import subprocess
import sys

import pytest

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.stage.code2wav.params import Code2WavLimits, Code2WavParams
from omnistage.stage.code2wav.request_preparer import Code2WavRequestPreparer
from omnistage.stage.code2wav.wire import Code2WavStageInfo, Code2WavStageRequest
from omnistage.stage.kinds import stage_kind
from omnistage.stage.request_preparer import RequestOptions

LIMITS = Code2WavLimits(
    voices=["Chelsie", "Ethan"],
    default_voice="Chelsie",
    codebook_size=8193,
    max_codes=16,
    sample_rate=24000,
)


@pytest.fixture
def preparer():
    config = StageConfig(stage_id=2, kind="code2wav", model="/nowhere", model_stage="code2wav")
    cls = stage_kind("code2wav").preparer_class()
    assert cls is Code2WavRequestPreparer
    return cls(config, Code2WavStageInfo(limits=LIMITS))


def options(**audio_params) -> RequestOptions:
    return RequestOptions.of(audio_params=audio_params)


def test_prepare_builds_the_wire_request(preparer):
    request = preparer.prepare(
        {"codes": [0, 5, 8192]}, options(voice="Ethan", seed=3, num_steps=4), Wants()
    )
    assert request == Code2WavStageRequest(
        codes=[0, 5, 8192], params=Code2WavParams(voice="Ethan", seed=3, num_steps=4)
    )
    assert preparer.prepare({"codes": (1, 2)}, RequestOptions.of(), Wants()).codes == [1, 2]


@pytest.mark.parametrize(
    ("audio_params", "field"),
    [
        ({"voice": "Nobody"}, "audio_params.voice"),
        ({"voice": ""}, "audio_params.voice"),
        ({"num_steps": 1}, "audio_params.num_steps"),
        ({"num_steps": 2.5}, "audio_params.num_steps"),
        ({"seed": "x"}, "audio_params.seed"),
        ({"guidance_scale": float("nan")}, "audio_params.guidance_scale"),
        ({"sway_coefficient": True}, "audio_params.sway_coefficient"),
        ({"speed": 2}, "audio_params.speed"),
        ({"first_chunk": 0}, "audio_params.first_chunk"),
        ({"first_chunk": 301}, "audio_params.first_chunk"),
        ({"first_chunk": True}, "audio_params.first_chunk"),
    ],
)
def test_bad_audio_params_name_the_field(preparer, audio_params, field):
    for check in (
        lambda: preparer.check_options(options(**audio_params)),
        lambda: preparer.prepare({"codes": [1]}, options(**audio_params), Wants()),
    ):
        with pytest.raises(InvalidRequestError) as info:
            check()
        assert info.value.field == field


def test_an_unknown_voice_lists_the_voices(preparer):
    with pytest.raises(InvalidRequestError, match="Chelsie.*Ethan") as info:
        preparer.check_options(options(voice="Nobody"))
    assert info.value.field == "audio_params.voice"


def test_audio_params_must_be_an_object(preparer):
    with pytest.raises(InvalidRequestError) as info:
        preparer.check_options(RequestOptions.of(audio_params=[1, 2]))  # type: ignore[arg-type]
    assert info.value.field == "audio_params"


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({}, "required"),
        ({"prompt": "hello"}, "required"),
        ({"codes": []}, "empty"),
        ({"codes": [1, 8193]}, r"8193 is outside the codebook \[0, 8193\)"),
        ({"codes": [-1]}, "outside the codebook"),
        ({"codes": [1] * 17}, "17 codes exceed this stage's limit of 16"),
        ({"codes": [1, 2.0]}, "list of integers"),
        ({"codes": [True]}, "list of integers"),
        ({"codes": "1 2 3"}, "list of integers"),
    ],
)
def test_bad_codes_name_codes(preparer, prompt, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        preparer.prepare(prompt, RequestOptions.of(), Wants())
    assert info.value.field == "codes"


def test_the_preparer_loads_no_model_code():
    script = (
        "import sys\n"
        "import omnistage.stage.code2wav.request_preparer\n"
        "loaded = [m for m in ('transformers', 'diffusers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
