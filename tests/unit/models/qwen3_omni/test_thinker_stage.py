"""The Qwen3-Omni thinker as an AR stage engine (paged KV cache, the runner's encoder step and
its DeepStack rows, interleaved multimodal positions): a text, an audio and an image request,
batched, each give transformers' ``thinker.generate`` greedy ids."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen3_omni.inputs import Qwen3OmniPromptProcessor
from omnistage.models.tokenizer import Tokenizer
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.ar.wire import MultiModalItem
from tests.unit.models.qwen3_omni.thinker_helpers import (
    hf_inputs,
    hf_processor,
    hf_thinker,
    media_of,
    messages_of,
    tiny_folder,
)
from tests.unit.stage.ar.helpers import generate, greedy, make_engine

CASES = ("text", "audio", "image")
STEPS = 6


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(tiny_folder(), model_stage="thinker", kv_cache_bytes=8 << 20)
    yield engine
    engine.shutdown()


@torch.no_grad()
def references() -> dict[str, list[int]]:
    folder = tiny_folder()
    hf, hf_proc = hf_thinker(folder), hf_processor(folder)
    out = {}
    for case in CASES:
        ref = hf_inputs(hf_proc, case)
        hf.model.rope_deltas = None
        ids = hf.generate(**ref, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
        out[case] = ids[0, ref["input_ids"].shape[1] :].tolist()
    return out


def test_batched_requests_give_transformers_greedy_ids(engine):
    folder = tiny_folder()
    processor, tokenizer = Qwen3OmniPromptProcessor(folder), Tokenizer.from_pretrained(folder)
    requests = []
    for case in CASES:
        prompt = processor.process(tokenizer.encode_chat(messages_of(case)), media_of(case), {})
        items = [
            MultiModalItem(i.modality, i.offset, i.length, i.data, i.content_hash)
            for i in prompt.items
        ]
        requests.append(
            ARRequest(
                case,
                prompt.token_ids,
                greedy(STEPS),
                multi_modal=items,
                positions=prompt.positions,
                position_delta=prompt.position_delta,
            )
        )
    results = generate(engine, requests)
    expected = references()
    for case in CASES:
        assert results[case].token_ids == expected[case], case
