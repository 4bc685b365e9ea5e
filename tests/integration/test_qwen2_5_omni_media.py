"""Qwen2.5-Omni hears and sees: prompts with audio, images and video, served as thinker →
talker → code2wav, against transformers' ``generate`` fed ``Qwen2_5OmniProcessor``'s outputs
for the same media (the talker prefill's mask restored, as tests/qwen2_5_omni_reference.py
explains): the thinker's ids, the talker's codes and the waveform are the same — alone,
beside other requests, after the thinker slept at level 2 and woke; the same picture runs
the encoder once; two pictures behind the same text share no cached block.

The reference's video pixels come from our own frame processing (transformers' video
processor needs torchvision): tests/unit/models/qwen2_5_omni/test_inputs.py checks them.
"""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.entrypoints.omni import Omni
from omnistage.models.media import MediaItem
from tests.qwen2_5_omni_media import CASES, build, hf_process, hf_processor, openai_parts, picture
from tests.qwen2_5_omni_reference import reference_generate

THINKER_TOKENS, TALKER_TOKENS, STEPS = 6, 16, 4
GREEDY = {"temperature": 0.0, "max_tokens": THINKER_TOKENS}
TALKER = {"temperature": 0.0, "max_tokens": TALKER_TOKENS}
SPEECH = {"voice": "Chelsie", "seed": 7, "num_steps": STEPS}


@pytest.fixture(scope="module")
def folder(tiny_qwen2_5_omni_folder):
    return str(tiny_qwen2_5_omni_folder)


@pytest.fixture(scope="module")
def omni(folder):
    omni = Omni.from_model(folder, in_process=True, enable_sleep_mode=True, kv_cache_bytes=8 << 20)
    yield omni
    omni.shutdown()


@pytest.fixture(scope="module")
def hf(folder):
    return hf_processor(folder)


@pytest.fixture(scope="module")
def references(folder, hf):
    """Per case: transformers' generate on its processor's outputs (computed once)."""
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            messages, _, options, kw = build(case)
            _, processed = hf_process(hf, messages, options, kw)
            outputs = {k: v for k, v in processed.items()}
            if options.get("use_audio_in_video"):
                outputs["use_audio_in_video"] = True
            cache[case] = reference_generate(
                folder,
                outputs["input_ids"][0].tolist(),
                voice=SPEECH["voice"],
                seed=SPEECH["seed"],
                thinker_max_new_tokens=THINKER_TOKENS,
                talker_max_new_tokens=TALKER_TOKENS,
                num_steps=STEPS,
                processor_outputs=outputs,
            )
        return cache[case]

    return get


def prompt_of(case: str) -> dict:
    messages, media, options, _ = build(case)
    return {"messages": messages, "multi_modal_data": media, "mm_processor_kwargs": options}


def speak(omni: Omni, prompts: list[dict]):
    return omni.generate(
        prompts, GREEDY, ["text", "audio"], talker_params=TALKER, audio_params=SPEECH
    )


def assert_same(out, ref) -> None:
    assert out.token_ids == ref.thinker_ids
    (audio,) = out.audio
    assert audio.codes == ref.talker_codes
    assert audio.samples.shape == ref.waveform.shape
    peak = float(np.abs(ref.waveform).max())
    assert float(np.abs(audio.samples - ref.waveform).max()) <= 1e-3 * peak


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_codes_and_waveform_match_transformers(omni, references, case):
    (out,) = speak(omni, [prompt_of(case)])
    assert_same(out, references(case))


def test_beside_seven_other_requests_each_gives_what_it_gives_alone(omni, references):
    cases = sorted(CASES)
    batch = [cases[i % len(cases)] for i in range(8)]
    together = speak(omni, [prompt_of(c) for c in batch])
    for case, out in zip(batch, together, strict=True):
        assert_same(out, references(case))


def test_after_the_thinker_slept_at_level_2_and_woke(omni, references):
    omni.sleep([0], level=2)
    omni.wake_up([0])  # Omni's wake serves again, as the server's (no resume call)
    assert not omni.stage_status()[0]["paused"]
    (out,) = speak(omni, [prompt_of("audio_image")])
    assert_same(out, references("audio_image"))


def test_vllms_multi_modal_data_mapping_gives_the_same(omni, references):
    messages, media, options, _ = build("audio_image")
    data = {
        "audio": [(m.value.samples, m.value.sampling_rate) for m in media if m.modality == "audio"],
        "image": [m.value for m in media if m.modality == "image"],
    }
    prompt = {"messages": messages, "multi_modal_data": data, "mm_processor_kwargs": options}
    (out,) = speak(omni, [prompt])
    assert_same(out, references("audio_image"))


def encoder_cache(omni: Omni) -> dict:
    return next(s for s in omni.stage_status() if s["stage_id"] == 0)["encoder_cache"]


def text_prompt(image, before: str = "") -> dict:
    content = [{"type": "image"}, {"type": "text", "text": "?"}]
    if before:
        content.insert(0, {"type": "text", "text": before})
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "multi_modal_data": [MediaItem("image", image, "")]}


def test_the_same_picture_runs_the_encoder_once_with_equal_output(omni):
    image = picture(112, 140, seed=21)
    item = {"multi_modal_data": [MediaItem("image", image, "picture-21")]}
    before = encoder_cache(omni)
    # Other text before it: the prefix cache cannot serve the picture's blocks.
    first = omni.generate(text_prompt(image, "Look:") | item, GREEDY, ["text"])[0]
    second = omni.generate(text_prompt(image, "See this") | item, GREEDY, ["text"])[0]
    after = encoder_cache(omni)
    assert after["queries"] - before["queries"] == 2
    assert after["hits"] - before["hits"] == 1
    fresh = {"multi_modal_data": [MediaItem("image", image, "picture-21-again")]}
    uncached = omni.generate(text_prompt(image, "See this") | fresh, GREEDY, ["text"])[0]
    assert second.token_ids == uncached.token_ids
    assert first.token_ids  # the reply itself is compared with transformers above


def test_two_pictures_behind_the_same_text_share_no_cached_block(omni, folder):
    from omnistage.models.tokenizer import Tokenizer

    one, other = picture(112, 140, seed=31), picture(112, 140, seed=32)
    prompt = text_prompt(one)
    ids = Tokenizer.from_pretrained(folder).encode_chat(prompt["messages"])
    before_picture = ids.index(6)  # <|vision_bos|>: what precedes it is the same text

    def cached_tokens() -> int:
        status = next(s for s in omni.stage_status() if s["stage_id"] == 0)
        return int(status["prefix_cache"]["hit_tokens"])

    omni.generate(prompt | {"multi_modal_data": [MediaItem("image", one, "p31")]}, GREEDY, ["text"])
    hits = cached_tokens()
    omni.generate(
        prompt | {"multi_modal_data": [MediaItem("image", other, "p32")]}, GREEDY, ["text"]
    )
    # Only whole blocks before the picture may come from the cache.
    assert cached_tokens() - hits <= before_picture
    again = cached_tokens()
    omni.generate(prompt | {"multi_modal_data": [MediaItem("image", one, "p31")]}, GREEDY, ["text"])
    assert cached_tokens() - again > before_picture  # the same picture does reuse its blocks


def test_openai_parts_in_python_messages_give_the_same(omni, references):
    parts, _, options, _ = openai_parts("audio_image")
    (out,) = speak(omni, [{"messages": parts, "mm_processor_kwargs": options}])
    assert_same(out, references("audio_image"))
