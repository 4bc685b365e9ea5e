"""A request's tokens and final hidden states do not depend on what runs beside it, bit for bit.

The hidden states condition the image stage, so a text+image request's PNG is only as
reproducible as they are (see ``omnistage/batch_invariance.py``). The same request runs alone,
then beside 63 text requests of other prompt lengths that arrive and finish at other times: its
prefill shares a concatenated batch, its decode steps see batches of many sizes and block tables
much wider than its own. Below the engine, the model and the decode attention are checked where
the engine test cannot reach on a tiny model (3 threads, contexts past 512 tokens).
"""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.models.ar_config import ARModelConfig
from omnistage.models.attention import (
    PaddedTorchSDPABackend,
    TorchSDPABackend,
    paged_decode_attention,
)
from omnistage.models.decoder import CausalLM, rowwise_rows
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.model_runner import ModelRunner, StepResult
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest, SequenceState
from tests.unit.stage.ar.helpers import Result, collect, greedy, make_engine

MAX_MODEL_LEN = 512  # as the demo thinker in pipelines/tiny-omni.yaml
TARGET_ID = "target"
TARGET_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(37)]
TARGET_PARAMS = {
    "greedy": greedy(64),
    "seeded": SamplingParams(
        temperature=0.9, top_p=0.95, top_k=64, seed=1234, max_tokens=64, ignore_eos=True
    ),
}
TARGET_STEP = 2  # the step at which the target arrives in the crowded run
# Three threads split elementwise ops into chunks that are not whole SIMD steps (two threads
# happen to split the demo's shapes evenly).
THREADS = 3


@pytest.fixture(autouse=True)
def three_torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def demo():
    return ensure_preset("demo", cache_dir() / "demo")


@pytest.fixture(scope="module")
def engine(demo):
    config = ARModelConfig.from_pretrained(str(demo))
    block_bytes = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * config.head_dim
    block_bytes *= 4  # fp32
    # 64 sequences of up to 512 tokens in blocks of 16: nothing is ever preempted.
    engine = make_engine(
        demo,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        kv_cache_bytes=(64 * MAX_MODEL_LEN // 16 + 1) * block_bytes,
    )
    yield engine
    engine.shutdown()


def crowd(seed: int) -> dict[int, list[ARRequest]]:
    """63 text requests by arrival step: some with the target, most before or after it."""
    rng = random.Random(seed)
    arrivals: dict[int, list[ARRequest]] = {}
    for i in range(63):
        prompt_len = rng.choice([1, 2, 5, 16, 17, 31, 64, 100, 200, 300, 420])
        max_tokens = min(rng.choice([1, 4, 12, 30, 60, 90]), MAX_MODEL_LEN - prompt_len)
        params = (
            greedy(max_tokens)
            if i % 3
            else SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        )
        step = rng.choice([0, 0, 0, 1, TARGET_STEP, TARGET_STEP, 4, 6, 9, 13, 18, 25])
        prompt = [rng.randrange(3, 512) for _ in range(prompt_len)]
        arrivals.setdefault(step, []).append(ARRequest(f"c{i}", prompt, params))
    return arrivals


class Recorder:
    """Wraps ``ModelRunner.run`` to note the batches the target ran in."""

    def __init__(self) -> None:
        self.runner_run = ModelRunner.run
        self.prefill_tokens: list[int] = []  # tokens of each prefill that held the target
        self.decode_batches: list[tuple[int, int]] = []  # (batch size, widest block table)

    def __call__(
        self, runner: ModelRunner, seqs: list[SequenceState], is_prefill: bool
    ) -> StepResult:
        if any(seq.request_id == TARGET_ID for seq in seqs):
            if is_prefill:
                self.prefill_tokens.append(sum(seq.num_tokens for seq in seqs))
            else:
                self.decode_batches.append((len(seqs), max(len(s.block_table) for s in seqs)))
        return self.runner_run(runner, seqs, is_prefill)


def run(
    engine: ARStageEngine, arrivals: dict[int, list[ARRequest]], monkeypatch
) -> tuple[Result, Recorder]:
    recorder = Recorder()
    monkeypatch.setattr(ModelRunner, "run", lambda runner, *args: recorder(runner, *args))
    results: dict[str, Result] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request in arrivals.get(step, []):
            engine.add_request(request)
        collect(engine.step(), results)
        step += 1
    monkeypatch.undo()
    return results[TARGET_ID], recorder


def target(kind: str) -> ARRequest:
    return ARRequest(TARGET_ID, TARGET_PROMPT, TARGET_PARAMS[kind], return_hidden_states=True)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_tokens_and_hidden_states_match_alone_beside_63_requests(engine, kind, monkeypatch):
    alone, _ = run(engine, {0: [target(kind)]}, monkeypatch)

    arrivals = crowd(seed={"greedy": 1, "seeded": 2}[kind])
    # The target's prefill is concatenated between other prompts.
    arrivals[TARGET_STEP].insert(len(arrivals[TARGET_STEP]) // 2, target(kind))
    crowded, seen = run(engine, arrivals, monkeypatch)

    assert engine.scheduler.num_preemptions == 0
    assert seen.prefill_tokens and seen.prefill_tokens[0] > 2 * len(TARGET_PROMPT)
    sizes = {size for size, _ in seen.decode_batches}
    widths = {width for _, width in seen.decode_batches}
    assert len(sizes) >= 5 and max(sizes) >= 32, sizes
    assert max(widths) >= 3 * 7, widths  # the target needs 7 blocks at most
    assert alone.final is not None and crowded.final is not None
    assert crowded.token_ids == alone.token_ids
    hidden_alone = alone.final.handoff["hidden_states"]
    hidden_crowded = crowded.final.handoff["hidden_states"]
    assert hidden_alone.shape == (len(TARGET_PROMPT) + 63, 256)
    differing = (hidden_crowded != hidden_alone).any(-1).nonzero().flatten().tolist()
    assert differing == [], f"hidden-state rows that differ: {differing}"
    assert torch.equal(hidden_crowded, hidden_alone)


@pytest.fixture(scope="module")
def demo_model(demo):
    torch.manual_seed(0)  # random weights serve as well as the checkpoint's here
    return CausalLM(ARModelConfig.from_pretrained(str(demo))).eval()


def prefill(model: CausalLM, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The hidden states of each prompt, all prefilled in one concatenated batch."""
    cu_seqlens = [0]
    for prompt in prompts:
        cu_seqlens.append(cu_seqlens[-1] + len(prompt))
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    metadata = TorchSDPABackend().prefill(
        torch.zeros_like(ids), cu_seqlens, [0] * len(prompts), None
    )
    with torch.no_grad():
        hidden = model(ids, positions, metadata, None)
    return [hidden[a:b] for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]


# (tokens before, tokens after) the target: with silu computed in place, each of these
# layouts changed the target's rows at 3 threads.
@pytest.mark.parametrize("before, after", [(50, 7), (50, 64), (333, 0), (700, 0), (1001, 500)])
def test_prefill_rows_do_not_depend_on_the_prompts_beside_them(demo_model, before, after):
    generator = torch.Generator().manual_seed(before * 1000 + after)
    prompt = torch.tensor(TARGET_PROMPT)
    (alone,) = prefill(demo_model, [prompt])
    others = [torch.randint(3, 512, (n,), generator=generator) for n in (before, after)]
    _, crowded, _ = prefill(demo_model, [others[0], prompt, others[1]])
    assert torch.equal(crowded, alone)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (14, 2, 64)])
def test_decode_attention_does_not_depend_on_the_batch(num_heads, num_kv_heads, head_dim):
    """Past 512 slots the CPU kernel's result depended on the batch's widest block table."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size = 400, 16
    kv_cache = tuple(
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
        for _ in range(2)
    )
    scale = head_dim**-0.5
    for length in (17, 511, 513, 1000, 3000):
        own = -(-length // block_size)
        table = torch.randperm(num_blocks, generator=generator)[:own]
        q = torch.randn(1, num_heads, head_dim, generator=generator)
        alone = paged_decode_attention(q, kv_cache, table[None], torch.tensor([length]), scale)
        for width in (own + 1, 2 * own, 256):
            for batch in (2, 7):
                tables = torch.randint(0, num_blocks, (batch, max(width, own)), generator=generator)
                tables[1, :own] = table
                tables[1, own:] = 0
                lengths = torch.randint(1, tables.shape[1] * block_size + 1, (batch,))
                lengths[1] = length
                queries = torch.randn(batch, num_heads, head_dim, generator=generator)
                queries[1] = q[0]
                out = paged_decode_attention(queries, kv_cache, tables, lengths, scale)
                assert torch.equal(out[1], alone[0]), (length, width, batch)


def test_the_graph_capturable_backend_keeps_shapes_fixed_by_the_block_tables():
    """Captured CUDA graphs need one call whose shapes follow ``block_tables`` alone."""
    meta = torch.device("meta")
    kv_cache = (torch.empty(9, 16, 2, 64, device=meta), torch.empty(9, 16, 2, 64, device=meta))
    q = torch.empty(3, 4, 64, device=meta)
    tables = torch.empty(3, 5, dtype=torch.long, device=meta)
    lengths = torch.empty(3, dtype=torch.long, device=meta)
    backend = PaddedTorchSDPABackend()
    assert backend.supports_cuda_graphs and not TorchSDPABackend.supports_cuda_graphs
    out = backend.decode_attention(q, kv_cache, tables, lengths, 0.125)
    assert out.shape == (3, 4, 64)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 16, 56])
@pytest.mark.parametrize("row_numel", [64, 1024, 4864, 100])
def test_rowwise_rows_make_every_thread_chunk_whole_simd_steps(threads, row_numel):
    for rows in [1, 2, 3, 7, 31, 32, 33, 65, 100, 333, 1001, 2048]:
        padded = rowwise_rows(rows, row_numel, threads)
        numel = padded * row_numel
        chunks = 1 if threads == 1 or numel < 32768 else min(threads, -(-numel // 32768))
        chunk = -(-numel // chunks)
        assert padded >= rows and chunk % 64 == 0 and numel % 64 == 0
        assert padded - rows < 64 * threads
