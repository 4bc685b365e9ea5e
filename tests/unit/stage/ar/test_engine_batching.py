import random

import pytest
import torch

from omnistage.stage.ar.sequence import ARRequest
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return build_micro(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(1)
    return [
        ARRequest(
            f"r{i}",
            [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))],
            greedy(rng.randint(4, 24)),
        )
        for i in range(32)
    ]


@pytest.fixture(scope="module")
def alone(micro, requests):
    """Each request's greedy tokens when it runs by itself."""
    engine = make_engine(micro)
    return {r.request_id: generate(engine, [r])[r.request_id].token_ids for r in requests}


def test_32_concurrent_requests_match_each_alone(micro, requests, alone):
    engine = make_engine(micro)
    results = generate(engine, requests)
    assert {rid: res.token_ids for rid, res in results.items()} == alone
    assert all(res.finish_reason == "length" for res in results.values())


def test_tiny_kv_cache_preempts_and_still_matches(micro, requests, alone):
    # 48 blocks of 4 tokens: a quarter of what 32 requests need at once.
    engine = make_engine(micro, block_size=4, max_model_len=96, kv_cache_bytes=49 * 2048)
    assert engine.worker.runner.num_kv_blocks == 48
    results = generate(engine, requests)
    assert engine.status()["num_preemptions"] > 0
    assert {rid: res.token_ids for rid, res in results.items()} == alone
    assert engine.block_manager.num_free_blocks == 48


def test_small_token_budget_splits_prefills_but_not_results(micro, requests, alone):
    engine = make_engine(micro, max_num_batched_tokens=64, max_num_seqs=5)
    results = generate(engine, requests[:12])
    assert {rid: res.token_ids for rid, res in results.items()} == {
        r.request_id: alone[r.request_id] for r in requests[:12]
    }


def test_hidden_states_cover_every_processed_token(micro):
    engine = make_engine(micro, block_size=4, max_model_len=96, kv_cache_bytes=49 * 2048)
    prompt = list(range(10, 30))
    request = ARRequest("h", prompt, greedy(12), return_hidden_states=True)
    result = generate(engine, [request])["h"]
    hidden = result.final.handoff["hidden_states"]
    tokens = prompt + result.token_ids[:-1]
    with torch.no_grad():
        expected = engine.worker.runner.model(torch.tensor(tokens), torch.arange(len(tokens)))
    assert hidden.shape == (len(tokens), 64)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_text_deltas_add_up_to_the_decoded_tokens(micro, requests):
    engine = make_engine(micro)
    results = generate(engine, requests[:8])
    for res in results.values():
        assert res.text == engine.tokenizer.decode(res.token_ids)


def test_a_preempted_sequence_hands_over_the_same_hidden_states_bit_for_bit(micro, requests):
    """Recomputed in one prefill, the hidden states of generated positions differ from the
    decode steps' in the last bits; a sequence that hands them over recomputes step by step
    instead (``SequenceState.rewind``): bit-equal, and its seeded draws continue as they would."""
    from omnistage.stage.ar.sampling_params import SamplingParams
    from tests.unit.stage.ar.helpers import collect, run_to_completion

    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    request = ARRequest("h", list(range(10, 30)), sampled, return_hidden_states=True)
    alone = generate(make_engine(micro), [request])["h"]

    engine = make_engine(micro)  # cut by a sleep that keeps it, then recomputed
    engine.add_request(ARRequest("h", list(range(10, 30)), sampled, return_hidden_states=True))
    results: dict = {}
    for _ in range(12):
        collect(engine.step(), results)
    assert engine.sleep(level=1, mode="keep").metadata.preempted == 1
    engine.wake_up(resume=True)
    run_to_completion(engine, results)
    cut = results["h"]
    assert cut.token_ids == alone.token_ids
    assert torch.equal(cut.final.handoff["hidden_states"], alone.final.handoff["hidden_states"])

    # Preempted again and again by a KV cache too small for the load around it.
    small = {"block_size": 4, "max_model_len": 96, "kv_cache_bytes": 49 * 2048}
    alone = generate(make_engine(micro, **small), [request])["h"]
    engine = make_engine(micro, **small)
    crowded = generate(engine, [*requests[:16], request])["h"]
    assert engine.status()["num_preemptions"] > 0
    assert crowded.token_ids == alone.token_ids
    assert torch.equal(crowded.final.handoff["hidden_states"], alone.final.handoff["hidden_states"])
