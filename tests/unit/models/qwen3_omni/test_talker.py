"""Qwen3-Omni's talker as our AR stage runs it — its prompt built from what the thinker stage
hands over (``processors.thinker_to_talker``), each step a frame of codes (the first sampled,
the others from the code predictor) — against transformers' own
``Qwen3OmniMoeForConditionalGeneration.generate`` on the tiny checkpoint: the thinker's ids
and every codebook of every frame are the same, greedily; also after the talker slept (level 1
and 2) and woke. A seeded sampled request gives the same frames twice."""

from __future__ import annotations

import functools

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.models.processors import UpstreamResult
from omnistage.models.qwen3_omni import processors
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.ar.wire import MultiModalItem
from tests.unit.models.qwen3_omni.thinker_helpers import (
    hf_inputs,
    hf_processor,
    media_of,
    messages_of,
    tiny_folder,
)

PROMPT = "Hello there, tell me"
THINKER_TOKENS, TALKER_TOKENS = 8, 12


@functools.cache
def hf_model():
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_folder(), dtype=torch.float32)
    return model.eval()


@functools.cache
def reference(case: str = "text") -> tuple[list[int], list[int], list[list[int]]]:
    """transformers' greedy generate: prompt ids, the thinker's new ids, the talker's frames."""
    from transformers import AutoTokenizer

    folder = tiny_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    if case == "text":
        messages = [{"role": "user", "content": PROMPT}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = {
            "input_ids": tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        }
    else:
        inputs = hf_inputs(hf_processor(folder), case)
    ids = inputs.pop("input_ids")
    model = hf_model()
    captured = {}
    talker_generate = model.talker.generate

    def generate(*args, **kwargs):
        captured["result"] = result = talker_generate(*args, **kwargs)
        return result

    model.talker.generate = generate
    sequences, _ = model.generate(
        ids,
        **inputs,
        speaker="Ethan",
        thinker_do_sample=False,
        talker_do_sample=False,
        thinker_max_new_tokens=THINKER_TOKENS,
        talker_max_new_tokens=TALKER_TOKENS,
        thinker_eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    steps = [h[-1] for h in captured["result"].hidden_states if h[-1] is not None]
    frames = torch.stack(steps, dim=1)[0].tolist()  # residual codes hold the whole frame
    return ids[0].tolist(), sequences[0, ids.shape[1] :].tolist(), frames


@pytest.fixture(scope="module")
def stages():
    folder = str(tiny_folder())
    make = functools.partial(
        StageConfig,
        kind="ar",
        model=folder,
        kv_cache_bytes=4 << 20,
        max_model_len=512,
        enable_sleep_mode=True,
    )
    thinker = ARStageEngine(make(stage_id=0, model_stage="thinker"), seed=0)
    talker = ARStageEngine(make(stage_id=1, model_stage="talker"), seed=0)
    yield folder, thinker, talker
    thinker.shutdown()
    talker.shutdown()


def run(engine: ARStageEngine, request: ARRequest) -> tuple[list[int], dict]:
    engine.add_request(request)
    ids: list[int] = []
    while True:
        for out in engine.step():
            ids += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                return ids, out.handoff or {}


def media_fields(folder: str, prompt_ids: list[int], case: str) -> dict:
    """The thinker request's multimodal items and positions for ``case`` (none for text),
    from our prompt processor (whose ids must be transformers')."""
    if case == "text":
        return {}
    from omnistage.models.qwen3_omni.inputs import Qwen3OmniPromptProcessor
    from omnistage.models.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(folder).encode_chat(messages_of(case))
    processed = Qwen3OmniPromptProcessor(folder).process(ids, media_of(case), {})
    assert processed.token_ids == prompt_ids
    return {
        "multi_modal": [
            MultiModalItem(i.modality, i.offset, i.length, i.data, i.content_hash)
            for i in processed.items
        ],
        "positions": processed.positions,
        "position_delta": processed.position_delta,
    }


def thinker_request(
    request_id: str, folder: str, prompt_ids: list[int], case: str, params: dict, **extra
) -> ARRequest:
    """A greedy thinker request asking for what the talker's processor wants."""
    omni, _ = processors.checkpoint_tokens(folder)
    wants = processors.talker_wants(folder, params)
    return ARRequest(
        request_id,
        prompt_ids,
        SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, stop_token_ids=[omni.im_end]),
        return_hidden_states=True,
        hidden_states_with_embeddings=True,
        text_embeddings_only=True,
        embed_token_ids=list(wants.embed_token_ids),
        hidden_layer=wants.hidden_layer,
        **media_fields(folder, prompt_ids, case),
        **extra,
    )


def talker_frames(
    stages, prompt_ids: list[int], talker_params: SamplingParams, seed: int = 0, case: str = "text"
):
    folder, thinker, talker = stages
    _, tokens = processors.checkpoint_tokens(folder)
    params = {"audio_params": {"voice": "Ethan"}}
    new_ids, handoff = run(thinker, thinker_request("thinker", folder, prompt_ids, case, params))
    upstream = UpstreamResult(
        token_ids=new_ids,
        hidden_states=handoff["hidden_states"],
        token_embeddings=handoff["token_embeddings"],
        num_prompt_tokens=len(prompt_ids),
        prompt_token_ids=handoff["prompt_token_ids"],
        params=params,
        positions=handoff.get("positions"),
        position_delta=handoff.get("position_delta", 0),
    )
    fields = processors.thinker_to_talker(upstream, folder)
    codes, _ = run(
        talker,
        ARRequest(
            f"talker-{seed}",
            fields["prompt_token_ids"],
            talker_params,
            prompt_embeds=fields["prompt_embeds"],
            token_embeds_from=fields["token_embeds_from"],
            decode_embeds=fields["decode_embeds"],
            positions=fields.get("positions"),
            position_delta=fields.get("position_delta", 0),
        ),
    )
    flat = processors.talker_to_code2wav(UpstreamResult(token_ids=codes), folder)["codes"]
    g = tokens.groups
    return new_ids, [flat[i : i + g] for i in range(0, len(flat), g)]


def greedy() -> SamplingParams:
    _, tokens = processors.checkpoint_tokens(str(tiny_folder()))
    return SamplingParams(
        temperature=0.0,
        max_tokens=TALKER_TOKENS,
        repetition_penalty=1.05,
        stop_token_ids=[tokens.eos],
    )


@pytest.mark.parametrize("case", ["text", "audio", "image"])
def test_thinker_ids_and_every_codebook_equal_transformers(stages, case):
    prompt_ids, thinker_ids, frames = reference(case)
    ours_ids, ours_frames = talker_frames(stages, prompt_ids, greedy(), case=case)
    assert ours_ids == thinker_ids
    assert ours_frames == frames
    assert len(frames) == TALKER_TOKENS - 1  # the step that ended on its length has no frame


@pytest.mark.parametrize("level", [1, 2])
def test_the_talker_speaks_the_same_after_sleeping(stages, level):
    _, _, talker = stages
    prompt_ids, _, frames = reference()
    talker.sleep(level)
    talker.wake_up()
    talker.resume()
    assert talker_frames(stages, prompt_ids, greedy())[1] == frames


def test_a_seeded_sampled_request_repeats_itself(stages):
    prompt_ids, _, _ = reference()
    sampled = SamplingParams(temperature=0.9, top_k=50, max_tokens=6, seed=3)
    first = talker_frames(stages, prompt_ids, sampled, seed=1)[1]
    assert talker_frames(stages, prompt_ids, sampled, seed=2)[1] == first
    assert len(first) == 5


@pytest.mark.parametrize("case", ["text", "image"])
def test_the_talker_fed_while_the_thinker_runs_speaks_the_same(stages, case):
    """The talker's request opens when the thinker starts; the thinker's rows reach it step
    by step (``thinker_rows``), and the two engines take turns: the talker waits for each
    decode embedding it needs, and its frames are those of the whole hand-off."""
    from omnistage.stage.ar.wire import ARStageRequest
    from omnistage.stage.core import upstream_update
    from omnistage.stage.messages import AppendInput, Handoff

    folder, thinker, talker = stages
    prompt_ids, thinker_ids, frames = reference(case)
    _, tokens = processors.checkpoint_tokens(folder)
    params = {"audio_params": {"voice": "Ethan"}}
    thinker.add_request(
        thinker_request("streamed", folder, prompt_ids, case, params, stream_hidden_states=True)
    )
    rows = processors.thinker_rows(folder, params)
    talker.add_streamed_request("streamed", ARStageRequest([], greedy()))
    said, codes, thinker_done, talker_done = [], [], False, False
    while not talker_done:
        if not thinker_done:
            for out in thinker.step():
                said += out.new_token_ids
                thinker_done = out.finished
                delta = Handoff(**out.delta) if out.delta else None
                msg = AppendInput("streamed", list(out.new_token_ids), out.finished, delta)
                fields, ended = rows.feed_update(upstream_update(msg), out.finished)
                talker.append_input("streamed", fields, ended)
        for out in talker.step():
            assert out.error is None, out.error
            codes += out.new_token_ids
            talker_done = out.finished
    assert said == thinker_ids
    flat = processors.talker_to_code2wav(UpstreamResult(token_ids=codes), folder)["codes"]
    g = tokens.groups
    assert [flat[i : i + g] for i in range(0, len(flat), g)] == frames


@pytest.mark.parametrize(("level", "asleep_after"), [(1, 0), (2, 0), (2, 3)])
def test_input_that_reaches_a_talker_asleep_with_keep_is_applied_when_it_wakes(
    stages, level, asleep_after
):
    """A streamed request admitted before a ``keep`` sleep: the thinker's rows that come
    while the talker sleeps (its prompt among them, or later decode rows) are kept and
    applied on wake, so it speaks as it would have (it used to be refused as asleep, and
    the request hung with nothing running or waiting)."""
    from omnistage.stage.ar.wire import ARStageRequest
    from omnistage.stage.core import upstream_update
    from omnistage.stage.messages import AppendInput, Handoff

    folder, thinker, talker = stages
    prompt_ids, thinker_ids, frames = reference()
    _, tokens = processors.checkpoint_tokens(folder)
    params = {"audio_params": {"voice": "Ethan"}}
    thinker.add_request(
        thinker_request("kept", folder, prompt_ids, "text", params, stream_hidden_states=True)
    )
    rows = processors.thinker_rows(folder, params)
    talker.add_streamed_request("kept", ARStageRequest([], greedy()))
    said, codes, fed, thinker_done, talker_done = [], [], 0, False, False
    asleep = False
    while not talker_done:
        if not thinker_done:
            for out in thinker.step():
                said += out.new_token_ids
                thinker_done = out.finished
                delta = Handoff(**out.delta) if out.delta else None
                msg = AppendInput("kept", list(out.new_token_ids), out.finished, delta)
                fields, ended = rows.feed_update(upstream_update(msg), out.finished)
                talker.append_input("kept", fields, ended)
                fed += 1
        if fed >= asleep_after and not asleep and not talker.is_sleeping():
            talker.sleep(level, mode="keep")
            asleep = True
        if asleep and (thinker_done or fed >= asleep_after + 4):
            talker.wake_up(resume=True)
            asleep, asleep_after = False, 1 << 30
        for out in talker.step():
            assert out.error is None, out.error
            codes += out.new_token_ids
            talker_done = out.finished
    assert said == thinker_ids
    flat = processors.talker_to_code2wav(UpstreamResult(token_ids=codes), folder)["codes"]
    g = tokens.groups
    assert [flat[i : i + g] for i in range(0, len(flat), g)] == frames
