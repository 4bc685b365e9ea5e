"""A Qwen3-TTS folder's pipeline (talker -> code2wav, as ``--model`` serves it) in process:
a request carrying its prompt as ``prompt_spec`` (ids; the talker stage embeds them) speaks
the official ``qwen-tts`` package's waveform bit for bit — its greedy ``generate``'s codes
decoded by its speech tokenizer — for a named voice and for an instruction, both text modes;
a spec the talker cannot read is a 400 naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.entrypoints.omni import Omni
from omnistage.errors import InvalidRequestError
from omnistage.models.qwen3_tts.config import read_config
from omnistage.models.qwen3_tts.prompt import talker_prompt
from tests.unit.models.qwen3_tts.checkpoints import write_codec, write_talker
from tests.unit.models.qwen3_tts.test_prompt import INSTRUCT, TEXT

FRAMES = 10
GREEDY = {"temperature": 0.0, "max_tokens": FRAMES}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_tts")
    talker = write_talker(folder)
    codec = write_codec(folder)
    return folder, talker, codec


@pytest.fixture(scope="module")
def omni(checkpoint):
    omni = Omni.from_model(str(checkpoint[0]), in_process=True)
    yield omni
    omni.shutdown()


def reference_waveform(talker, codec, case: dict, non_streaming_mode: bool) -> np.ndarray:
    instruct = [torch.tensor([INSTRUCT])] if case.get("instruct") else [None]
    with torch.no_grad():
        codes, _ = talker.generate(
            input_ids=[torch.tensor([TEXT])], instruct_ids=instruct,
            languages=[case["language"]], speakers=[case["speaker"]],
            non_streaming_mode=non_streaming_mode, max_new_tokens=FRAMES, do_sample=False,
            subtalker_dosample=False,
        )  # fmt: skip
        ((wav,),) = codec.decode(codes[0][None], return_dict=False)
    return wav.float().numpy()


def speech_prompt(folder, case: dict, non_streaming_mode: bool) -> dict:
    prompt = talker_prompt(
        read_config(folder), TEXT, language=case["language"], speaker=case["speaker"],
        instruct_ids=INSTRUCT if case.get("instruct") else None,
        non_streaming_mode=non_streaming_mode,
    )  # fmt: skip
    pad = read_config(folder).codec.pad  # the prompt's ids count for lengths only
    return {"prompt_token_ids": [pad] * len(prompt), "prompt_spec": prompt.spec()}


CASES = [
    {"speaker": "vivian", "language": "english"},
    {"speaker": "dylan", "language": "auto", "instruct": True},
]


@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_the_pipeline_speaks_the_packages_waveform(checkpoint, omni, case, non_streaming_mode):
    folder, talker, codec = checkpoint
    # the package's sampling defaults (repetition penalty 1.05, at least 2 frames) apply
    (out,) = omni.generate(speech_prompt(folder, case, non_streaming_mode), GREEDY, ["audio"])
    (audio,) = out.audio
    expected = reference_waveform(talker, codec, case, non_streaming_mode)
    assert audio.sample_rate == 24000 and len(expected) >= 2 * 1920
    assert np.array_equal(audio.samples, expected)


def test_a_bad_prompt_spec_is_named(checkpoint, omni):
    folder = checkpoint[0]
    prompt = speech_prompt(folder, CASES[0], True)
    prompt["prompt_spec"] = {**prompt["prompt_spec"], "body_ids": "hello"}
    with pytest.raises(InvalidRequestError, match="prompt_spec.body_ids"):
        omni.generate(prompt, GREEDY, ["audio"])
    (out,) = omni.generate(speech_prompt(folder, CASES[0], True), GREEDY, ["audio"])
    assert len(out.audio[0].samples) > 0  # the stages serve on
