"""Tensor-parallel decoders: two gloo ranks (spawned processes), each loading its slices
straight from the checkpoint, compute the logits one rank computes — on Qwen2 (tied
embeddings), multi-query Qwen2 (one kv head for two ranks), Qwen3, Qwen3-MoE (experts split
over their features) and Llama checkpoints that transformers built, and with a vocabulary the
ranks do not divide.

A rank sends its results as plain arrays: a tensor put on a multiprocessing queue travels as
a handle to shared memory that dies with the rank, so a rank that exits before the test reads
its result would leave a handle to nothing (an EOFError at random)."""

from __future__ import annotations

import multiprocessing
import tempfile
from pathlib import Path

import pytest
import torch

from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.decoder import CausalLM
from omnistage.models.loader import load_module
from omnistage.models.tensor_parallel import (
    SINGLE,
    TPGroup,
    join_group,
    kv_head_split,
    padded_split,
    shards_of,
)
from tests.unit.models.hf_checkpoints import TP_ARCHS, build_checkpoint

IDS = [[5, 17, 301, 42, 7, 99, 250, 3], [11, 480, 2]]


def logits_of(folder: Path, tp: TPGroup) -> list[torch.Tensor]:
    config = ARModelConfig.from_pretrained(folder)
    family = registry.family(config.family)
    model = family.build_decoder(config, torch.float32, tp)
    arena = Arena("cpu")
    arena.adopt(model)
    load_module(model, folder, rename=family.rename(None))
    model.model.rotary_emb.to("cpu")
    out = []
    with torch.no_grad():
        for ids in IDS:
            ids_t = torch.tensor(ids)
            hidden = model(ids_t, torch.arange(len(ids)))
            out.append(model.compute_logits(hidden))
    return out


def rank_main(folder: str, store: str, rank: int, queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    try:
        tp = join_group(store, rank, 2, torch.device("cpu"))
        queue.put((rank, [t.numpy() for t in logits_of(Path(folder), tp)]))
    except BaseException as exc:  # reported to the test
        queue.put((rank, repr(exc)))


def tp2_logits(folder: Path) -> list[torch.Tensor]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="omnistage-tp-test-")
    procs = [ctx.Process(target=rank_main, args=(str(folder), store, r, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, got in results.items():
        assert not isinstance(got, str), f"rank {rank}: {got}"
    logits = {rank: [torch.from_numpy(a) for a in got] for rank, got in results.items()}
    # Both ranks end with the whole logits (gathered): they agree exactly.
    for a, b in zip(logits[0], logits[1], strict=True):
        assert torch.equal(a, b)
    return logits[0]


@pytest.fixture(scope="module", params=TP_ARCHS)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, folder)
    return folder


def test_two_ranks_compute_the_logits_of_one(checkpoint):
    one = logits_of(checkpoint, SINGLE)
    two = tp2_logits(checkpoint)
    for a, b in zip(one, two, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        assert float((la - lb).abs().max()) < 1e-4


def test_shards_name_each_ranks_slice():
    config = ARModelConfig(
        model_type="qwen2", vocab_size=511, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    shards = [shards_of(CausalLM.on_meta(config, torch.float32, TPGroup(r, 2))) for r in (0, 1)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [(s[q].start, s[q].length) for s in shards] == [(0, 32), (32, 32)]
    k = "model.layers.0.self_attn.k_proj.weight"  # one kv head, replicated
    assert [(s[k].start, s[k].length) for s in shards] == [(0, 16), (0, 16)]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert [(s[o].dim, s[o].start) for s in shards] == [(1, 0), (1, 32)]
    e = "model.embed_tokens.weight"  # 511 rows in blocks of 256: the last rank padded
    assert [(s[e].start, s[e].length) for s in shards] == [(0, 256), (256, 255)]
    assert padded_split(511, TPGroup(1, 2)) == (256, 255, 256)
    assert kv_head_split(4, TPGroup(1, 2)) == (2, 2) and kv_head_split(2, TPGroup(3, 4)) == (1, 1)
    with pytest.raises(ValueError, match="divide"):
        kv_head_split(3, TPGroup(0, 2))


def part_outputs(folder: str, part: str, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen2.5-Omni part's logits from input embeddings, and its token embeddings."""
    config = ARModelConfig.from_pretrained(folder, part)
    family = registry.family(config.family)
    model = family.build_decoder(config, torch.float32, tp)
    arena = Arena("cpu")
    arena.adopt(model)
    load_module(model, folder, rename=family.rename(part))
    model.model.rotary_emb.to("cpu")
    embeds = torch.randn(7, config.embedding_size or config.hidden_size, generator=seeded()) * 0.1
    with torch.no_grad():
        hidden = model(None, torch.arange(7), inputs_embeds=embeds)
        return model.compute_logits(hidden), model.embed(torch.tensor([1, 5, 9, 3]))


def seeded() -> torch.Generator:  # the same stream on every rank
    return torch.Generator().manual_seed(0)


def omni_rank(folder: str, store: str, rank: int, queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    tp = join_group(store, rank, 2, torch.device("cpu"))
    outputs = {p: part_outputs(folder, p, tp) for p in ("thinker", "talker")}
    queue.put((rank, {p: tuple(t.numpy() for t in pair) for p, pair in outputs.items()}))


def test_qwen2_5_omni_thinker_and_talker_split_over_two_ranks():
    from omnistage.models.tiny import ensure_preset
    from omnistage.pipelines import cache_dir

    folder = str(ensure_preset("tiny-qwen2.5-omni", cache_dir() / "tiny-qwen2.5-omni"))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="omnistage-tp-test-")
    procs = [ctx.Process(target=omni_rank, args=(folder, store, r, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for part in ("thinker", "talker"):
        logits, embeddings = part_outputs(folder, part, SINGLE)
        rank0_logits, rank0_embeddings = (torch.from_numpy(a) for a in results[0][part])
        torch.testing.assert_close(rank0_logits, logits, atol=1e-5, rtol=1e-4)
        assert torch.equal(rank0_embeddings, embeddings)  # a sum of one non-zero row
