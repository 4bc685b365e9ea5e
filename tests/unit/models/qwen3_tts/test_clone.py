"""A cloned voice (a Base checkpoint's ``ref_audio``) through the Qwen3-TTS pipeline in process,
against the official ``qwen-tts`` package's ``generate_voice_clone`` on a tiny Base checkpoint
written by its own classes: the prompt rows equal ``generate``'s (ICL and x-vector-only, both
text modes), the talker's greedy codes (every codebook) and the whole waveform are the
package's bit for bit, the stage's encoders sleep apart under their own tags, and a bad clone
is a 400 naming its field while the stages serve on. A given ``speaker_embedding`` speaks as the
package's ``generate_voice_clone`` with that vector as its ``voice_clone_prompt``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.entrypoints.omni import Omni
from omnistage.errors import InvalidRequestError
from omnistage.memory import Arena
from omnistage.models.interfaces import SpeechInput
from omnistage.models.qwen3_tts import FAMILY
from omnistage.models.qwen3_tts.talker import Talker, talker_config
from omnistage.models.tokenizer import Tokenizer
from tests.unit.models.qwen3_tts.checkpoints import write_base

FRAMES = 8
GREEDY = {"temperature": 0.0, "max_tokens": FRAMES}
TEXT = "hello there, how are you"
REF_TEXT = "this is the reference"


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    """A seeded sine with noise at 24 kHz, float32."""
    n = round(seconds * 24000)
    t = np.arange(n) / 24000
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.4 * np.sin(2 * np.pi * 190.0 * t) + 0.1 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_tts_base")
    return folder, write_base(folder)


@pytest.fixture(scope="module")
def omni(checkpoint):
    # hand-offs whole: speech after a clone's reference frames is not streamed
    omni = Omni.from_model(str(checkpoint[0]), in_process=True, stream=False)
    yield omni
    omni.shutdown()


def speech(samples: np.ndarray, xvec: bool, non_streaming: bool | None = None) -> SpeechInput:
    return SpeechInput(
        TEXT, language="english", ref_audio=(samples, 24000),
        ref_text=None if xvec else REF_TEXT, x_vector_only_mode=xvec or None,
        non_streaming_mode=non_streaming,
    )  # fmt: skip


def prompt_of(folder, request: SpeechInput) -> tuple[dict, dict | None]:
    """The family's prompt and the code2wav stage's parameters it carries."""
    prompt = FAMILY.speech_prompt(str(folder), Tokenizer.from_pretrained(folder).encode, request)
    return prompt, prompt.get("request_params", {}).get("audio_params")


def reference(model, samples: np.ndarray, xvec: bool, non_streaming: bool = False):
    """``generate_voice_clone``'s waveform, and the talker codes its ``generate`` returned
    (and its prompt rows: what the talker's first forward took)."""
    taken: dict = {}
    generate = model.model.generate

    def spy_generate(*args, **kwargs):
        taken["codes"] = generate(*args, **kwargs)[0][0]
        return [taken["codes"]], None

    def spy_forward(module, args, kwargs):
        taken.setdefault("rows", kwargs.get("inputs_embeds"))
        taken.setdefault("trailing", kwargs.get("trailing_text_hidden"))

    model.model.generate = spy_generate
    hook = model.model.talker.register_forward_pre_hook(spy_forward, with_kwargs=True)
    try:
        wavs, rate = model.generate_voice_clone(
            TEXT, language="english", ref_audio=(samples, 24000),
            ref_text=None if xvec else REF_TEXT, x_vector_only_mode=xvec,
            non_streaming_mode=non_streaming, max_new_tokens=FRAMES, do_sample=False,
            subtalker_dosample=False,
        )  # fmt: skip
    finally:
        del model.model.generate
        hook.remove()
    assert rate == 24000
    return wavs[0], taken


@pytest.fixture(scope="module")
def talker(checkpoint):
    """Our talker with its encoders, in an arena, loaded from the checkpoint."""
    import json

    from omnistage.models.loader import load_into, module_targets

    folder = checkpoint[0]
    config = talker_config(json.loads((folder / "config.json").read_text()))
    arena = Arena("cpu")
    model = Talker.on_meta(config, torch.float32)
    arena.adopt(model)
    model.model.rotary_emb.to("cpu")
    from omnistage.models.qwen3_tts.talker import talker_rename

    load_into(module_targets(model), folder, rename=talker_rename)
    model.adopt_components(arena, folder, load=True)
    yield model, arena
    arena.close()


@pytest.mark.parametrize("non_streaming", [False, True])
@pytest.mark.parametrize("xvec", [False, True])
def test_the_prompt_rows_are_the_references(checkpoint, talker, xvec, non_streaming):
    folder, model = checkpoint
    samples = clip(1.3)
    _, taken = reference(model, samples, xvec, non_streaming)
    prompt, audio_params = prompt_of(folder, speech(samples, xvec, non_streaming))
    with torch.inference_mode():
        rows, trailing, context = talker[0].embed_prompt_spec(prompt["prompt_spec"])
    assert torch.equal(rows, taken["rows"][0])
    expected = taken["trailing"][0]
    assert torch.equal(trailing[: len(expected)], expected)
    assert len(prompt["prompt_token_ids"]) == len(rows)
    if xvec:
        assert context == [] and audio_params is None
    else:
        frames = -(-len(samples) // 1920)
        assert len(context) == 16 * frames and audio_params == {"context_frames": frames}


@pytest.mark.parametrize("xvec", [False, True])
def test_the_clone_speaks_the_packages_waveform(checkpoint, omni, xvec):
    folder, model = checkpoint
    samples = clip(2.1, seed=3)
    expected, taken = reference(model, samples, xvec)
    prompt, audio_params = prompt_of(folder, speech(samples, xvec))
    (out,) = omni.generate(prompt, GREEDY, ["audio"])
    (audio,) = out.audio
    codes = np.asarray(audio.codes).reshape(-1, 16)
    ours = codes[-len(taken["codes"]) :] if len(taken["codes"]) else codes[:0]
    assert np.array_equal(ours, taken["codes"].numpy())  # every codebook of every frame
    assert len(expected) > 0
    assert np.array_equal(audio.samples, expected.astype(np.float32))


def test_the_encoders_sleep_apart(talker):
    model, arena = talker
    assert model.component_tags == ["speaker_encoder", "codec_encoder"]
    assert {"weights", "speaker_encoder", "codec_encoder"} <= set(arena.tags)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"ref_audio": None}, "ref_audio"),
        ({"ref_text": None, "x_vector_only_mode": None}, "ref_text"),
        ({"ref_audio": (np.zeros(100, np.float32), 24000)}, "ref_audio"),
        ({"ref_audio": (np.zeros(31 * 24000, np.float32), 24000)}, "ref_audio"),
        ({"ref_audio": (np.zeros(24000, np.float32), 16000)}, "ref_audio"),
        ({"instructions": "happy"}, "instructions"),
        ({"task_type": "CustomVoice"}, "task_type"),
    ],
)
def test_a_bad_clone_is_named(checkpoint, omni, change, field):
    import dataclasses

    folder = checkpoint[0]
    bad = dataclasses.replace(speech(clip(0.5), xvec=False), **change)
    with pytest.raises(InvalidRequestError) as err:
        prompt_of(folder, bad)
    assert err.value.field == field


def test_the_stages_serve_on_after_a_bad_spec(checkpoint, omni):
    folder = checkpoint[0]
    prompt, audio_params = prompt_of(folder, speech(clip(0.5), xvec=False))
    bad = {**prompt, "prompt_spec": {**prompt["prompt_spec"], "ref_audio": b"123"}}
    with pytest.raises(InvalidRequestError, match="ref_audio"):
        omni.generate(bad, GREEDY, ["audio"])
    (out,) = omni.generate(prompt, GREEDY, ["audio"])
    assert len(out.audio[0].samples) > 0


def embedding_reference(model, vector: torch.Tensor):
    """``generate_voice_clone`` from a precomputed x-vector (a ``VoiceClonePromptItem``)."""
    from qwen_tts import VoiceClonePromptItem

    item = VoiceClonePromptItem(
        ref_code=None, ref_spk_embedding=vector, x_vector_only_mode=True, icl_mode=False
    )
    wavs, rate = model.generate_voice_clone(
        TEXT, language="english", voice_clone_prompt=[item], max_new_tokens=FRAMES,
        do_sample=False, subtalker_dosample=False,
    )  # fmt: skip
    assert rate == 24000
    return wavs[0]


def test_a_given_embedding_speaks_the_packages_clone(checkpoint, omni):
    folder, model = checkpoint
    width = model.model.config.talker_config.hidden_size
    vector = torch.randn(width, generator=torch.Generator().manual_seed(5))
    expected = embedding_reference(model, vector)
    given = SpeechInput(TEXT, language="english", speaker_embedding=tuple(vector.tolist()))
    prompt, audio_params = prompt_of(folder, given)
    assert audio_params is None and "ref_audio" not in prompt["prompt_spec"]
    (out,) = omni.generate(prompt, GREEDY, ["audio"])
    assert len(expected) > 0
    assert np.array_equal(out.audio[0].samples, expected.astype(np.float32))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda width: {"speaker_embedding": (0.5,) * (width - 1)}, "speaker_embedding"),
        (lambda width: {"speaker_embedding": (float("nan"),) * width}, "speaker_embedding"),
        (lambda width: {"ref_audio": (clip(0.5), 24000)}, "speaker_embedding"),
        (lambda width: {"ref_text": REF_TEXT}, "ref_text"),
        (lambda width: {"x_vector_only_mode": False}, "x_vector_only_mode"),
    ],
)
def test_a_bad_given_embedding_is_named(checkpoint, change, field):
    import dataclasses

    folder, model = checkpoint
    width = model.model.config.talker_config.hidden_size
    good = SpeechInput(TEXT, speaker_embedding=(0.1,) * width)
    with pytest.raises(InvalidRequestError) as err:
        prompt_of(folder, dataclasses.replace(good, **change(width)))
    assert err.value.field == field
