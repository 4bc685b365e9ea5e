"""Qwen3-TTS's talker as our AR stage runs it — its prompt and trailing text rows from
``prompt.embed_prompt`` with the talker's own tables, each step a frame of codes (the first
from the talker, the others from its code predictor) — against the official ``qwen-tts``
package's greedy ``Qwen3TTSForConditionalGeneration.generate`` on a tiny random checkpoint
saved by the package itself: every codebook of every frame is the same, for each variant's
prompt and both text modes, and after the talker slept (level 1 and 2) and woke; and a seeded
sampled request draws the package's codes under ``torch.manual_seed`` of that seed."""

from __future__ import annotations

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.models.qwen3_tts.config import read_config
from omnistage.models.qwen3_tts.prompt import embed_prompt, talker_prompt
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.models.qwen3_tts.checkpoints import write_talker
from tests.unit.models.qwen3_tts.test_prompt import INSTRUCT, TEXT

FRAMES = 12
PENALTY = 1.05  # the package's default: over the generated first codes only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A custom-voice checkpoint written by the package (``checkpoints.write_talker``)."""
    folder = tmp_path_factory.mktemp("qwen3_tts")
    return folder, write_talker(folder)


@pytest.fixture(scope="module")
def talker(checkpoint):
    folder, _ = checkpoint
    config = StageConfig(
        stage_id=0, kind="ar", model=str(folder), model_stage="talker",
        kv_cache_memory=4 << 20, max_model_len=512, enable_sleep_mode=True,
    )  # fmt: skip
    engine = ARStageEngine(config, seed=0)
    yield engine
    engine.shutdown()


SEED = 123
SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}  # the checkpoint's subtalker_* too


def reference_frames(
    model, case: dict, non_streaming_mode: bool, seed: int | None = None
) -> list[list[int]]:
    instruct = [torch.tensor([INSTRUCT])] if case.get("instruct") else [None]
    sampled: dict = {"do_sample": False, "subtalker_dosample": False}
    if seed is not None:  # the package draws from the global generator
        torch.manual_seed(seed)
        sampled = {"do_sample": True, "subtalker_dosample": True, **SAMPLED}
        sampled.update({f"subtalker_{k}": v for k, v in SAMPLED.items()})
    with torch.no_grad():
        codes, _ = model.generate(
            input_ids=[torch.tensor([TEXT])], instruct_ids=instruct,
            languages=[case["language"]], speakers=[case["speaker"]],
            non_streaming_mode=non_streaming_mode, max_new_tokens=FRAMES,
            repetition_penalty=PENALTY, **sampled,
        )  # fmt: skip
    return codes[0].tolist()


def our_frames(
    engine: ARStageEngine, folder, case: dict, non_streaming_mode: bool, seed: int | None = None
):
    tts = read_config(folder)
    prompt = talker_prompt(
        tts, TEXT, language=case["language"], speaker=case["speaker"],
        instruct_ids=INSTRUCT if case.get("instruct") else None,
        non_streaming_mode=non_streaming_mode,
    )  # fmt: skip
    model = engine.worker.runner.model
    with torch.no_grad():
        rows, trailing = embed_prompt(prompt, model.embed_text, model.embed)
    sampled = {"temperature": 0.0} if seed is None else {**SAMPLED, "seed": seed}
    params = SamplingParams(
        max_tokens=FRAMES, min_tokens=2, repetition_penalty=PENALTY,
        stop_token_ids=[tts.codec.eos], **sampled,
    )  # fmt: skip
    # the prompt's ids count for lengths only: the codec pad, which the talker never draws
    engine.add_request(
        ARRequest("tts", [tts.codec.pad] * len(rows), params, prompt_embeds=rows,
                  decode_embeds=trailing)
    )  # fmt: skip
    codes: list[int] = []
    while True:
        for out in engine.step():
            codes += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                groups = tts.num_code_groups
                frames = [codes[i : i + groups] for i in range(0, len(codes), groups)]
                return [f for f in frames if len(f) == groups and f[0] != tts.codec.eos]


CASES = [
    {"speaker": "vivian", "language": "english"},
    {"speaker": "dylan", "language": "auto", "instruct": True},
]


@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_every_codebook_equals_the_packages(checkpoint, talker, case, non_streaming_mode):
    folder, model = checkpoint
    want = reference_frames(model, case, non_streaming_mode)
    assert len(want) >= 2
    assert our_frames(talker, folder, case, non_streaming_mode) == want


@pytest.mark.parametrize("case", CASES)
def test_a_seeded_draw_is_the_packages(checkpoint, talker, case):
    """Every code drawn — the talker's first of each frame and its code predictor's 15 — is the
    package's under the same seed: each draw is over the whole row, in the package's order."""
    folder, model = checkpoint
    want = reference_frames(model, case, True, seed=SEED)
    assert want != reference_frames(model, case, True)  # a draw, not the argmax
    assert our_frames(talker, folder, case, True, seed=SEED) == want


@pytest.mark.parametrize("level", [1, 2])
def test_the_talker_speaks_the_same_after_sleeping(checkpoint, talker, level):
    folder, model = checkpoint
    talker.sleep(level)
    talker.wake_up()
    talker.resume()
    assert our_frames(talker, folder, CASES[0], True) == reference_frames(model, CASES[0], True)


def test_a_folder_is_served_as_talker_then_code2wav(checkpoint):
    from omnistage.pipelines import pipeline_from_model

    folder, _ = checkpoint
    stages = pipeline_from_model(str(folder)).stages
    assert [(s.kind, s.model_stage, s.input_processor) for s in stages] == [
        ("ar", "talker", None),
        ("code2wav", "code2wav", "qwen3_tts.talker_to_code2wav"),
    ]
