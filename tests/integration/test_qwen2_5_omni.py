"""Qwen2.5-Omni served as thinker → talker → code2wav, against transformers' own
``Qwen2_5OmniForConditionalGeneration.generate`` on tiny random checkpoints that transformers
builds and saves (two configurations, three prompts each): the thinker's token ids, the
talker's codes and the waveform are the same, also after the three stages slept (levels 2, 1,
2) and woke; concurrent audio requests give what each gives alone. (Speech is synthesised in
one piece here, ``stream=False``; the chunked synthesis is tested against it in
tests/unit/stage/code2wav/test_streaming.py and over HTTP in tests/e2e/test_qwen2_5_omni_api.py.)

The talker's prefill adds the codec pad/bos embeddings to its last two positions as the
original Qwen code and transformers 4.x do (transformers 5.x as shipped loses them for an
unpadded request: see tests/qwen2_5_omni_reference.py, ``codec_prefill_embeds``).
"""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen2_5_omni import tiny as tiny_qwen2_5_omni
from tests.qwen2_5_omni_reference import reference_generate

PROMPTS = ["Hello there", "Tell me a story about a cat", "1 2 3"]
THINKER_TOKENS, TALKER_TOKENS, STEPS = 8, 24, 4
GREEDY = {"temperature": 0.0, "max_tokens": THINKER_TOKENS}
TALKER = {"temperature": 0.0, "max_tokens": TALKER_TOKENS}  # rep. penalty 1.05 by default


@pytest.fixture(scope="module", params=["default", "alt"])
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen-omni-{request.param}")
    tiny_qwen2_5_omni.build_tiny_qwen2_5_omni(
        folder, tiny_qwen2_5_omni.TINY_QWEN_OMNI_SPECS[request.param]
    )
    omni = Omni.from_model(  # speech in one piece, as transformers speaks it
        str(folder), in_process=True, enable_sleep_mode=True, kv_cache_bytes=8 << 20, stream=False
    )
    yield str(folder), omni
    omni.shutdown()


def speak(omni: Omni, prompts: list[str], voice: str = "Chelsie", seed: int = 7):
    return omni.generate(
        [{"messages": [{"role": "user", "content": p}]} for p in prompts],
        GREEDY,
        ["text", "audio"],
        talker_params=TALKER,
        audio_params={"voice": voice, "seed": seed, "num_steps": STEPS},
    )


def reference(folder: str, prompt: str, voice: str = "Chelsie", seed: int = 7):
    return reference_generate(
        folder,
        prompt,
        voice=voice,
        seed=seed,
        thinker_max_new_tokens=THINKER_TOKENS,
        talker_max_new_tokens=TALKER_TOKENS,
        num_steps=STEPS,
    )


def assert_same(out, ref) -> None:
    assert out.token_ids == ref.thinker_ids
    (audio,) = out.audio
    assert audio.codes == ref.talker_codes
    assert audio.sample_rate == 24000 and audio.samples.dtype == np.float32
    assert audio.samples.shape == ref.waveform.shape
    peak = float(np.abs(ref.waveform).max())
    assert float(np.abs(audio.samples - ref.waveform).max()) <= 1e-3 * peak


@pytest.mark.parametrize("prompt", PROMPTS)
def test_thinker_talker_and_waveform_match_transformers(served, prompt):
    folder, omni = served
    (out,) = speak(omni, [prompt])
    assert_same(out, reference(folder, prompt))


def test_the_other_voice_and_seed_match_too(served):
    folder, omni = served
    (out,) = speak(omni, [PROMPTS[0]], voice="Ethan", seed=11)
    assert_same(out, reference(folder, PROMPTS[0], voice="Ethan", seed=11))


def test_text_only_requests_skip_the_talker(served):
    _, omni = served
    (out,) = omni.generate(PROMPTS[0], GREEDY, ["text"])
    assert out.text and not out.audio


def test_eight_concurrent_audio_requests_give_what_each_gives_alone(served):
    _, omni = served
    prompts = [PROMPTS[i % 3] for i in range(8)]
    alone = {p: speak(omni, [p])[0] for p in PROMPTS}
    together = speak(omni, prompts)
    for prompt, out in zip(prompts, together, strict=True):
        assert out.token_ids == alone[prompt].token_ids
        assert out.audio[0].codes == alone[prompt].audio[0].codes
        assert np.array_equal(out.audio[0].samples, alone[prompt].audio[0].samples)


def test_the_seeds_sleep_sequence_leaves_the_audio_unchanged(served):
    folder, omni = served
    before = speak(omni, [PROMPTS[1]])[0]
    omni.sleep([0], level=2)
    omni.sleep([1], level=1)
    omni.sleep([2], level=2)
    status = {s["stage_id"]: s for s in omni.stage_status()}
    assert all(status[i]["state"] == "asleep" for i in range(3))
    omni.wake_up([0, 1, 2])
    omni.resume_generation([0, 1])  # AR stages wait for it after a wake (the Python API)
    after = speak(omni, [PROMPTS[1]])[0]
    assert after.token_ids == before.token_ids
    assert after.audio[0].codes == before.audio[0].codes
    assert np.array_equal(after.audio[0].samples, before.audio[0].samples)
    assert_same(after, reference(folder, PROMPTS[1]))
