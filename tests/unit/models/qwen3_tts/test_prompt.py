"""The talker's prompt rows equal what the official ``qwen-tts`` package feeds its talker
(``Qwen3TTSForConditionalGeneration.generate``'s ``inputs_embeds``, ``trailing_text_hidden``
and ``tts_pad_embed``), for every variant, with and without an instruction, a dialect speaker,
both text modes; and a bad language or voice is a 400 naming the field."""

from __future__ import annotations

import functools

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen3_tts.config import read_config
from omnistage.models.qwen3_tts.prompt import SPEAKER_VECTOR, embed_prompt, talker_prompt
from tests.qwen3_tts_reference import qwen_tts
from tests.unit.models.qwen3_tts.test_config import write_folder

# <|im_start|> assistant \n <text> <|im_end|> \n <|im_start|> assistant \n (ids of the tiny vocab)
TEXT = [190, 195, 196, 11, 12, 13, 14, 15, 191, 196, 190, 195, 196]
INSTRUCT = [190, 197, 196, 40, 41, 42, 191, 196]


class Captured(Exception):
    pass


@functools.cache
def reference(variant: str, folder_root: str):
    from pathlib import Path

    qwen_tts()
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    folder = Path(folder_root) / variant
    config = write_folder(folder, variant)
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    with torch.no_grad():  # a random talker: its default init leaves biases at zero
        for param in model.talker.parameters():
            param.normal_(0, 0.5)
    return folder, model


def reference_inputs(model, **kwargs):
    """What ``generate`` hands its talker, captured before any step runs."""
    seen = {}

    def talker_generate(**inputs):
        seen.update(inputs)
        raise Captured

    model.talker.generate = talker_generate
    with pytest.raises(Captured), torch.no_grad():
        model.generate(max_new_tokens=2, do_sample=False, subtalker_dosample=False, **kwargs)
    return seen["inputs_embeds"][0], seen["trailing_text_hidden"][0], seen["tts_pad_embed"][0, 0]


CASES = [
    ("custom_voice", {"speakers": ["Vivian"], "languages": ["English"]}),
    ("custom_voice", {"speakers": ["vivian"], "languages": ["Auto"], "instruct": True}),
    ("custom_voice", {"speakers": ["dylan"], "languages": ["chinese"]}),  # speaks its dialect
    ("custom_voice", {"speakers": ["dylan"], "languages": ["english"]}),
    ("voice_design", {"speakers": [None], "languages": ["auto"], "instruct": True}),
    ("base", {"speakers": [None], "languages": ["english"], "clone": True}),
]


@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize(("variant", "case"), CASES)
def test_the_prompt_is_the_references(tmp_path_factory, variant, case, non_streaming_mode):
    root = tmp_path_factory.getbasetemp() / "qwen3_tts_prompt"
    folder, model = reference(variant, str(root))
    instruct = [torch.tensor([INSTRUCT])] if case.get("instruct") else [None]
    vector = torch.randn(
        model.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    clone = None
    if case.get("clone"):
        clone = {"ref_code": None, "ref_spk_embedding": [vector], "x_vector_only_mode": [True],
                 "icl_mode": [False]}  # fmt: skip
    want_rows, want_trailing, want_pad = reference_inputs(
        model, input_ids=[torch.tensor([TEXT])], instruct_ids=instruct, voice_clone_prompt=clone,
        languages=case["languages"], speakers=case["speakers"],
        non_streaming_mode=non_streaming_mode,
    )  # fmt: skip
    config = read_config(folder)
    prompt = talker_prompt(
        config, TEXT, language=case["languages"][0], speaker=case["speakers"][0],
        speaker_vector=clone is not None, instruct_ids=INSTRUCT if case.get("instruct") else None,
        non_streaming_mode=non_streaming_mode,
    )  # fmt: skip
    talker = model.talker
    with torch.no_grad():
        rows, trailing = embed_prompt(
            prompt,
            lambda ids: talker.text_projection(talker.get_text_embeddings()(ids)),
            talker.get_input_embeddings(),
            vector if clone is not None else None,
        )
    assert (SPEAKER_VECTOR in prompt.codec_ids) == (clone is not None)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)
    torch.testing.assert_close(trailing[:-1], want_trailing[: len(trailing) - 1], rtol=0, atol=0)
    torch.testing.assert_close(trailing[-1], want_pad, rtol=0, atol=0)
    assert len(want_trailing) == max(len(trailing) - 1, 1)


def test_a_bad_language_or_voice_is_named(tmp_path_factory):
    folder, _ = reference("custom_voice", str(tmp_path_factory.getbasetemp() / "qwen3_tts_prompt"))
    config = read_config(folder)
    with pytest.raises(InvalidRequestError, match="unknown language 'klingon'") as info:
        talker_prompt(config, TEXT, language="klingon", speaker="vivian")
    assert info.value.field == "language" and "english" in str(info.value)
    with pytest.raises(InvalidRequestError, match=r"unknown voice 'nobody'.*\['dylan', 'vivian'\]"):
        talker_prompt(config, TEXT, speaker="nobody")
    with pytest.raises(InvalidRequestError, match="no text to speak"):
        talker_prompt(config, TEXT[:3] + TEXT[-5:], speaker="vivian")
