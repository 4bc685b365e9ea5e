"""Generic decoder parts other families need, against transformers' own modules: interleaved
multimodal RoPE and a mixture of experts with a shared expert (both Qwen3-Omni's)."""

import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from omnistage.models.ar_config import ARModelConfig, RopeConfig
from omnistage.models.decoder import Experts, RotaryEmbedding


def test_interleaved_mrope_equals_transformers():
    section = [3, 3, 2]  # sums to head_dim / 2 = 8
    config = hf_config.Qwen3OmniMoeTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    theirs = hf.Qwen3OmniMoeThinkerTextRotaryEmbedding(config)
    ours = RotaryEmbedding(16, RopeConfig(mrope_section=tuple(section), mrope_interleaved=True))
    positions = torch.stack([torch.arange(9), torch.arange(9) // 3, torch.arange(9) % 3])
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    our_cos, our_sin = ours(positions, torch.float32)
    torch.testing.assert_close(our_cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(our_sin, sin[0], rtol=0, atol=0)
    plain = RotaryEmbedding(16, RopeConfig(mrope_section=tuple(section)))
    assert not torch.equal(plain(positions, torch.float32)[0], our_cos)  # a real difference


def test_experts_with_a_shared_expert_equal_transformers():
    torch.manual_seed(0)
    raw = {
        "hidden_size": 32, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
    }  # fmt: skip
    theirs = hf.Qwen3OmniMoeTalkerTextSparseMoeBlock(
        hf_config.Qwen3OmniMoeTalkerTextConfig(**raw, intermediate_size=48)
    ).eval()
    for p in theirs.parameters():
        p.data.normal_(0, 0.2)
    config = ARModelConfig(
        model_type="test", vocab_size=8, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )  # fmt: skip
    ours = Experts(config, torch.float32)
    inner = raw["moe_intermediate_size"]
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            gate_up = theirs.experts.gate_up_proj[e]
            expert.gate_proj.weight.copy_(gate_up[:inner])
            expert.up_proj.weight.copy_(gate_up[inner:])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
        assert ours.shared_expert is not None and ours.shared_expert_gate is not None
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(
                getattr(theirs.shared_expert, name).weight
            )
        ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
        x = torch.randn(7, 32)
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-6, atol=1e-6)
