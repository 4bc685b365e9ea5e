"""The multimodal way into an AR stage: an item's embeddings replace its placeholders'
(the runner's encoder step), equal to transformers' ``generate`` on ``inputs_embeds`` built by
hand; the prefix cache reuses an item's k/v only for the same content; bad items are refused
naming the field."""

from __future__ import annotations

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.ar.wire import MultiModalItem
from tests.unit.models.hf_checkpoints import VOCAB, build_checkpoint
from tests.unit.stage.ar.helpers import greedy, make_engine, run_to_completion

PLACEHOLDER = 7
# Two full 16-token blocks before the item's end, so a second request can hit the cache.
PROMPT = [11, 12, 13, *[PLACEHOLDER] * 20, 14, 15, 16, 17, 18, 19, 20, 21, 22]
OFFSET, LENGTH, NEW = 3, 20, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("qwen2-tied", tmp_path_factory.mktemp("mm"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    _, folder = checkpoint
    engine = make_engine(folder, max_model_len=128, kv_cache_bytes=1 << 20)
    yield engine
    engine.shutdown()


def embeds(seed: int, hidden: int = 64) -> torch.Tensor:
    return torch.randn(LENGTH, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


def item(seed: int, content_hash: str | None = None) -> MultiModalItem:
    return MultiModalItem(
        "embeds", OFFSET, LENGTH, {"embeds": embeds(seed)}, content_hash or f"seed-{seed}"
    )


def reference(hf, seed: int) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        inputs = hf.get_input_embeddings()(ids)
        inputs[0, OFFSET : OFFSET + LENGTH] = embeds(seed)
        out = hf.generate(
            inputs_embeds=inputs,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0].tolist()


def generate(engine: ARStageEngine, request_id: str, items: list[MultiModalItem]) -> list[int]:
    engine.add_request(ARRequest(request_id, PROMPT, greedy(NEW), multi_modal=items))
    return run_to_completion(engine)[request_id].token_ids


def test_an_items_embeddings_replace_its_placeholders_as_transformers_inputs_embeds(
    engine, checkpoint
):
    hf, _ = checkpoint
    assert engine.info().multi_modal == ["embeds"]
    assert generate(engine, "a", [item(1)]) == reference(hf, 1)
    assert generate(engine, "plain", []) != reference(hf, 1)  # the placeholders alone differ


def test_the_prefix_cache_reuses_an_items_kv_only_for_the_same_content(engine, checkpoint):
    hf, _ = checkpoint
    first = generate(engine, "b1", [item(2)])
    hits = engine.block_manager.stats.hit_tokens
    assert generate(engine, "b2", [item(2)]) == first == reference(hf, 2)
    assert engine.block_manager.stats.hit_tokens > hits  # same ids, same content: a hit
    hits = engine.block_manager.stats.hit_tokens
    assert generate(engine, "c", [item(3)]) == reference(hf, 3)  # same ids, other content
    assert engine.block_manager.stats.hit_tokens == hits


def test_an_item_without_a_content_hash_never_shares_its_blocks(engine, checkpoint):
    hf, _ = checkpoint
    unnamed = MultiModalItem("embeds", OFFSET, LENGTH, {"embeds": embeds(4)})
    hits = engine.block_manager.stats.hit_tokens
    assert generate(engine, "d1", [unnamed]) == generate(engine, "d2", [unnamed])
    assert engine.block_manager.stats.hit_tokens == hits


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (MultiModalItem("audio", OFFSET, LENGTH, {}, "h"), "multi_modal.0.modality"),
        (MultiModalItem("embeds", 30, LENGTH, {"embeds": embeds(1)}, "h"), "multi_modal.0"),
        (
            MultiModalItem("embeds", OFFSET, 4, {"embeds": embeds(1)}, "h"),
            "multi_modal.0.data.embeds",
        ),
        (
            MultiModalItem("embeds", OFFSET, LENGTH, {"embeds": embeds(1) * float("nan")}, "h"),
            "multi_modal.0.data.embeds",
        ),
    ],
)
def test_a_bad_item_is_refused_naming_the_field(engine, bad, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(ARRequest("bad", PROMPT, greedy(NEW), multi_modal=[bad]))
    assert info.value.field == field


def test_an_empty_placeholder_range_is_refused_where_the_item_is_made():
    with pytest.raises(InvalidRequestError, match="multi_modal"):
        MultiModalItem("embeds", 0, 0)
    assert VOCAB > PLACEHOLDER
