"""The decoder, as each registered decoder family builds it, against transformers on random
tiny checkpoints transformers saved itself — through each attention backend."""

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.attention import ATTENTION_BACKENDS
from omnistage.models.decoder import CausalLM
from omnistage.models.loader import load_module
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from tests.unit.models.hf_checkpoints import ARCHS, VOCAB, build_checkpoint


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def load_ours(folder) -> CausalLM:
    config = ARModelConfig.from_pretrained(folder)
    family = registry.family(config.family)
    model = family.build_decoder(config, torch.float32)
    Arena("cpu").adopt(model)
    load_module(model, folder, rename=family.rename(None))
    return model


def test_config_reads_the_architecture(checkpoint):
    hf, folder = checkpoint
    config = ARModelConfig.from_pretrained(folder)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.head_dim == hf.model.layers[0].self_attn.head_dim
    assert config.rope.rope_type == hf.config.rope_parameters["rope_type"]


def test_logits_match_transformers(checkpoint):
    hf, folder = checkpoint
    ours = load_ours(folder)
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        logits = ours.compute_logits(ours(ids, torch.arange(48)))
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend_name", sorted(ATTENTION_BACKENDS))
def test_paged_decode_logits_match_transformers(checkpoint, backend_name):
    """Two sequences prefilled into scattered cache blocks, then decoded together."""
    hf, folder = checkpoint
    ours = load_ours(folder)
    backend = ATTENTION_BACKENDS[backend_name]()
    config = ours.config
    block_size, num_prefill, length = 4, 10, 24
    shape = (16, block_size, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    tables = [[3, 9, 1, 14, 6, 0], [5, 2, 11, 7, 12, 8]]
    seqs = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))

    def slots(seq: int, positions) -> list[int]:
        return [tables[seq][p // block_size] * block_size + p % block_size for p in positions]

    with torch.no_grad():
        expected = hf(seqs).logits
        prefill = backend.prefill(
            torch.tensor(slots(0, range(num_prefill)) + slots(1, range(num_prefill))),
            [0, num_prefill, 2 * num_prefill],
            [0, 0],
            None,
        )
        ours(seqs[:, :num_prefill].flatten(), torch.arange(num_prefill).repeat(2), prefill, caches)
        for pos in range(num_prefill, length):
            decode = backend.decode(
                torch.tensor(slots(0, [pos]) + slots(1, [pos])),
                torch.tensor(tables),
                torch.tensor([pos + 1, pos + 1]),
            )
            hidden = ours(seqs[:, pos], torch.tensor([pos, pos]), decode, caches)
            diff = (ours.compute_logits(hidden) - expected[:, pos]).abs().max().item()
            assert diff <= 1e-4, f"position {pos}: {diff}"


def test_greedy_ids_match_transformers_generate(checkpoint):
    hf, folder = checkpoint
    config = StageConfig(
        stage_id=0, kind="ar", model=str(folder), kv_cache_bytes=1 << 20, max_model_len=128
    )
    engine = ARStageEngine(config)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 9, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(ARRequest(str(i), prompt, params))
    ours: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert ours[str(i)] == expected, f"prompt {i}"
    engine.shutdown()
