"""The sizes of the tiny Qwen2.5-Omni checkpoints ``tiny_qwen2_5_omni`` builds: the default
(the ``tiny-qwen2.5-omni`` preset), an alternative with other head and layer counts, tied
thinker embeddings and one unsharded file, so tests cover two configurations, and a
bench-size one (the ``bench-qwen2.5-omni`` preset) for ``omnistage bench``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyQwenOmniSpec:
    """Sizes of a tiny Qwen2.5-Omni (defaults: the ``tiny-qwen2.5-omni`` preset)."""

    # thinker text decoder (head_dim = hidden / heads, as Qwen2.5-Omni's text config has)
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    mrope_section: tuple[int, int, int] = (2, 3, 3)  # sums to head_dim / 2
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    # talker (explicit head_dim != hidden / heads, as the real talker: 896 / 12 heads x 128)
    talker_vocab_size: int = 128
    talker_hidden_size: int = 48
    talker_intermediate_size: int = 96
    talker_num_layers: int = 2
    talker_num_heads: int = 4
    talker_num_kv_heads: int = 2
    talker_head_dim: int = 16
    talker_mrope_section: tuple[int, int, int] = (2, 3, 3)
    # codec ids, laid out like the real ones (pad 8292, bos 8293, eos 8294, mask 8296 of 8448)
    codec_pad_id: int = 120
    codec_bos_id: int = 121
    codec_eos_id: int = 122
    codec_mask_id: int = 124
    # token2wav DiT
    dit_hidden_size: int = 64
    dit_num_layers: int = 4
    dit_num_heads: int = 4
    dit_head_dim: int = 16
    dit_ff_mult: int = 2
    dit_emb_dim: int = 32  # codec embedding width
    dit_block_size: int = 8
    dit_look_ahead_layers: tuple[int, ...] = (2,)
    dit_look_backward_layers: tuple[int, ...] = (0, 3)
    dit_repeats: int = 2
    dit_max_position_embeddings: int = 4096  # mel frames = codes x repeats
    mel_dim: int = 80
    enc_emb_dim: int = 32  # the voice's ``cond`` vector
    enc_dim: int = 16  # ECAPA speaker encoder output (from ``ref_mel``)
    enc_channels: tuple[int, ...] = (32, 32, 32, 32, 96)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 16
    enc_se_channels: int = 16
    # token2wav BigVGAN (waveform samples per mel frame = prod(upsample_rates))
    bigvgan_initial_channel: int = 32
    upsample_rates: tuple[int, ...] = (5, 3, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5))
    # voices and files
    ref_mel_frames: int = 40
    max_shard_size: str | None = "1MB"  # None: one model.safetensors

    @property
    def samples_per_code(self) -> int:
        """Waveform samples per talker code: repeats x the BigVGAN's total upsampling."""
        total = self.dit_repeats
        for rate in self.upsample_rates:
            total *= rate
        return total


DEFAULT = TinyQwenOmniSpec()
ALT = TinyQwenOmniSpec(
    vocab_size=384,
    hidden_size=96,
    intermediate_size=192,
    num_layers=3,
    num_heads=3,
    num_kv_heads=1,
    tie_word_embeddings=True,
    mrope_section=(4, 6, 6),
    talker_vocab_size=96,
    talker_hidden_size=40,
    talker_intermediate_size=80,
    talker_num_layers=3,
    talker_num_heads=2,
    talker_num_kv_heads=1,
    talker_head_dim=32,
    talker_mrope_section=(4, 6, 6),
    codec_pad_id=88,
    codec_bos_id=89,
    codec_eos_id=90,
    codec_mask_id=92,
    dit_hidden_size=48,
    dit_num_layers=3,
    dit_num_heads=3,
    dit_head_dim=16,
    dit_emb_dim=24,
    dit_block_size=4,
    dit_look_ahead_layers=(1,),
    dit_look_backward_layers=(0, 2),
    mel_dim=32,
    enc_emb_dim=24,
    enc_dim=12,
    enc_channels=(24, 24, 24, 24, 72),
    enc_attention_channels=8,
    enc_se_channels=8,
    bigvgan_initial_channel=16,
    upsample_rates=(4, 2),
    upsample_kernel_sizes=(8, 4),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1, 3, 5),),
    ref_mel_frames=24,
    max_shard_size=None,
)
# Bench size: laid out like the real Qwen2.5-Omni-7B (head_dim 64, the real 128 halved; the
# DiT's 24-frame blocks; BigVGAN's six upsamplings to 480 samples per code: 50 codes per
# second of 24 kHz audio), narrower and shallower so that a request of a few hundred codes
# takes seconds on 2 CPU cores, code2wav a large share of it. 256 greedy codes are ~5 s of
# audio. (Not in TINY_QWEN_OMNI_SPECS: the tests' specs, each built several times.)
BENCH = TinyQwenOmniSpec(
    vocab_size=2048,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    mrope_section=(8, 12, 12),
    talker_vocab_size=1024,
    talker_hidden_size=256,
    talker_intermediate_size=768,
    talker_num_layers=4,
    talker_num_heads=4,
    talker_num_kv_heads=2,
    talker_head_dim=64,
    talker_mrope_section=(8, 12, 12),
    codec_pad_id=1000,
    codec_bos_id=1001,
    codec_eos_id=1002,
    codec_mask_id=1004,
    dit_hidden_size=128,
    dit_num_layers=4,
    dit_num_heads=2,
    dit_head_dim=64,
    dit_emb_dim=64,
    dit_block_size=24,
    dit_look_ahead_layers=(2,),
    dit_look_backward_layers=(0, 3),
    enc_emb_dim=64,
    enc_dim=64,
    enc_channels=(64, 64, 64, 64, 192),
    enc_attention_channels=32,
    enc_se_channels=32,
    bigvgan_initial_channel=64,
    upsample_rates=(5, 3, 2, 2, 2, 2),
    upsample_kernel_sizes=(11, 7, 4, 4, 4, 4),
    resblock_kernel_sizes=(3, 7),
    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    ref_mel_frames=100,
    max_shard_size=None,
)
TINY_QWEN_OMNI_SPECS: dict[str, TinyQwenOmniSpec] = {"default": DEFAULT, "alt": ALT}
