"""What RL rollouts need from the AR engine: logprobs that equal transformers' log-softmax,
``n`` reproducible samples from one prefill, and a prefix cache that hits (prompts of one
prefix arriving together compute it once) and can never serve a stale prefix after the
weights change or the KV cache is released."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omnistage.config import StageConfig
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.types import StageOutput
from tests.unit.models.hf_checkpoints import ARCHS, VOCAB, build_checkpoint

PROMPT = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(5)).tolist()


def make_engine(folder, **overrides) -> ARStageEngine:
    fields = {
        "stage_id": 0,
        "kind": "ar",
        "model": str(folder),
        "kv_cache_bytes": 1 << 20,
        "max_model_len": 128,
        "enable_sleep_mode": True,
        **overrides,
    }
    return ARStageEngine(StageConfig(**fields), seed=0)  # type: ignore[arg-type]


def run(
    engine: ARStageEngine, requests: list[ARRequest]
) -> dict[tuple[str, int], list[StageOutput]]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[tuple[str, int], list[StageOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    return outputs


def tokens(outputs: list[StageOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_logprobs_equal_transformers_log_softmax(checkpoint, sampled):
    hf, folder = checkpoint
    engine = make_engine(folder)
    params = SamplingParams(
        temperature=0.8 if sampled else 0.0, seed=3, max_tokens=12, ignore_eos=True,
        logprobs=5, prompt_logprobs=3,
    )  # fmt: skip
    outs = run(engine, [ARRequest("r", PROMPT, params)])[("r", 0)]
    generated = tokens(outs)
    entries = [e for out in outs for e in out.logprobs or []]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + generated])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    assert len(entries) == len(generated)
    for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
        row = expected[len(PROMPT) - 1 + i]
        assert entry.token_ids[0] == token
        assert abs(entry.logprobs[0] - row[token].item()) <= 1e-4
        assert entry.ranks[0] == int((row > row[token]).sum()) + 1
        top = torch.topk(row, 5)
        assert entry.token_ids[1:] == top.indices.tolist() and entry.ranks[1:] == [1, 2, 3, 4, 5]
        pairs = zip(entry.logprobs[1:], top.values.tolist(), strict=True)
        assert max(abs(a - b) for a, b in pairs) <= 1e-4
    prompt = outs[0].prompt_logprobs
    assert prompt is not None and prompt[0] is None and len(prompt) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        entry, row = prompt[j], expected[j - 1]
        assert entry is not None and entry.token_ids[0] == PROMPT[j]
        assert abs(entry.logprobs[0] - row[PROMPT[j]].item()) <= 1e-4
        assert entry.token_ids[1:] == torch.topk(row, 3).indices.tolist()
    engine.shutdown()


def test_processed_logprobs_are_those_of_the_distribution_sampled(checkpoint):
    _, folder = checkpoint
    engine = make_engine(folder, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=6, logprobs=3,
                            ignore_eos=True)  # fmt: skip
    outs = run(engine, [ARRequest("p", PROMPT, params)])[("p", 0)]
    for entry in (e for out in outs for e in out.logprobs or []):
        probs = torch.tensor(entry.logprobs[1:]).exp()
        assert abs(probs.sum().item() - 1.0) <= 1e-5  # top-k 3 holds every probability
        assert entry.ranks[0] <= 3
    engine.shutdown()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_checkpoint("qwen2-tied", tmp_path_factory.mktemp("qwen2"))


def test_n_samples_are_reproducible_and_each_equals_its_own_request(qwen2):
    _, folder = qwen2
    engine = make_engine(folder)
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    prefilled = engine.num_prefill_tokens
    first = run(engine, [ARRequest("a", PROMPT, params)])
    assert engine.num_prefill_tokens - prefilled == len(PROMPT)  # the prompt, once
    assert sorted(first) == [("a", i) for i in range(4)]
    again = run(engine, [ARRequest("b", PROMPT, params)])
    samples = [tokens(first[("a", i)]) for i in range(4)]
    assert samples == [tokens(again[("b", i)]) for i in range(4)]
    assert len({tuple(s) for s in samples}) > 1  # they are different samples
    fresh = make_engine(folder, enable_prefix_caching=False)
    for i in range(4):
        single = SamplingParams(n=1, temperature=1.0, seed=42 + i, max_tokens=10, ignore_eos=True)
        alone = run(fresh, [ARRequest(f"s{i}", PROMPT, single)])[(f"s{i}", 0)]
        assert tokens(alone) == samples[i], f"sample {i}"
    fresh.shutdown()
    engine.shutdown()


def test_aborting_a_request_ends_all_its_samples(qwen2):
    _, folder = qwen2
    engine = make_engine(folder)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True)
    engine.add_request(ARRequest("x", PROMPT, params))
    engine.step()  # prefilled and forked
    engine.abort("x")
    ended = [out for out in engine.step() if out.finished]
    assert sorted(out.index for out in ended) == [0, 1, 2]
    assert {out.finish_reason for out in ended} == {"abort"}
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.worker.num_kv_blocks
    engine.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = PROMPT + PROMPT  # 74 tokens: four full blocks of 16 to share


def test_a_shared_prefix_hits_and_gives_what_no_cache_gives(qwen2):
    _, folder = qwen2
    cached, plain = make_engine(folder), make_engine(folder, enable_prefix_caching=False)
    prompts = [SHARED + [7, 8, 9], SHARED + [10], SHARED[:70]]
    for i, prompt in enumerate(prompts):
        outs = run(cached, [ARRequest(f"c{i}", prompt, GREEDY)])[(f"c{i}", 0)]
        expected = run(plain, [ARRequest(f"p{i}", prompt, GREEDY)])[(f"p{i}", 0)]
        assert tokens(outs) == tokens(expected)
    stats = cached.status()["prefix_cache"]
    assert stats["hit_tokens"] >= 2 * 64 and 0 < stats["hit_rate"] < 1
    # Prompts of a new prefix arriving together: one computes it, the others wait a step
    # and find its four blocks cached (not computed three times in one step).
    together = [SHARED[::-1] + [7, 8, 9], SHARED[::-1] + [10], SHARED[::-1] + [11, 12]]
    before = cached.num_prefill_tokens
    outs = run(cached, [ARRequest(f"t{i}", q, GREEDY) for i, q in enumerate(together)])
    assert cached.num_prefill_tokens - before == 77 + (75 - 64) + (76 - 64)
    for i, prompt in enumerate(together):
        expected = run(plain, [ARRequest(f"q{i}", prompt, GREEDY)])[(f"q{i}", 0)]
        assert tokens(outs[(f"t{i}", 0)]) == tokens(expected)
    cached.shutdown()
    plain.shutdown()


def _perturbed(folder, out) -> str:
    from omnistage.models.loader import SafetensorsFile

    with SafetensorsFile(folder / "model.safetensors") as st:
        name = next(k for k in st.keys() if k.endswith("layers.0.mlp.down_proj.weight"))  # noqa: SIM118
        weight = st.tensor(name)
    save_file({name: torch.randn(weight.shape, generator=torch.Generator().manual_seed(9))}, out)
    return str(out)


@pytest.mark.parametrize("change", ["update_weights", "sleep-1", "sleep-2", "kv-only"])
def test_no_stale_prefix_after_the_weights_or_the_kv_cache_change(qwen2, tmp_path, change):
    _, folder = qwen2
    engine = make_engine(folder)
    run(engine, [ARRequest("warm", SHARED + [1], GREEDY)])  # the prefix is cached now
    if change == "update_weights":
        update = _perturbed(folder, tmp_path / "update.safetensors")
        assert engine.update_weights(update).status == "SUCCESS"
    else:
        level, tags = (1, ["kv_cache"]) if change == "kv-only" else (int(change[-1]), None)
        engine.sleep(level=level, tags=tags)
        engine.wake_up()
        engine.resume()
    hits = engine.status()["prefix_cache"]["hit_tokens"]
    after = tokens(run(engine, [ARRequest("after", SHARED + [2], GREEDY)])[("after", 0)])
    assert engine.status()["prefix_cache"]["hit_tokens"] == hits  # nothing reused
    fresh = make_engine(folder, enable_prefix_caching=False)
    if change == "update_weights":
        fresh.update_weights(update)
    expected = tokens(run(fresh, [ARRequest("fresh", SHARED + [2], GREEDY)])[("fresh", 0)])
    assert after == expected
    fresh.shutdown()
    engine.shutdown()
