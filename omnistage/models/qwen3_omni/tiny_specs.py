"""The sizes of the tiny Qwen3-Omni checkpoint ``tiny`` builds (the ``tiny-qwen3-omni``
preset). Proportions follow the real ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` config where they
shape the code paths: head_dim != hidden / heads in the thinker and the talker (q is twice the
hidden width in both), grouped KV heads, interleaved mRoPE whose T section is the largest, MoE
everywhere (the talker's with a gated shared expert), the talker reading a middle thinker layer
past the deepstack injections, code predictor and talker of one width, code2wav's sliding
window shorter than a reply."""

from __future__ import annotations

from dataclasses import dataclass

# Offsets of the codec special ids above the codebook, the real talker's (codebook 2048: pad
# 2148, bos 2149, eos 2150, nothink 2155, think_bos 2156, think_eos 2157; voices 2301-2303).
CODEC_OFFSETS: dict[str, int] = {
    "codec_pad_id": 100,
    "codec_bos_id": 101,
    "codec_eos_token_id": 102,
    "codec_nothink_id": 107,
    "codec_think_bos_id": 108,
    "codec_think_eos_id": 109,
}
VOICE_OFFSETS: dict[str, int] = {"chelsie": 253, "ethan": 254, "aiden": 255}
# transformers' generate suppresses the top 1024 ids of the talker vocabulary (all but
# codec_eos): the block of specials above the codebook must be exactly that wide, or real
# codes are suppressed too (a smaller vocabulary would leave only codec_eos sampleable).
SUPPRESSED_BLOCK = 1024


@dataclass(frozen=True)
class TinyQwen3OmniSpec:
    """Sizes of a tiny Qwen3-Omni (defaults: the ``tiny-qwen3-omni`` preset)."""

    # thinker text decoder (MoE, qk-norm, explicit head_dim: q = heads x head_dim = 2 x hidden)
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    mrope_section: tuple[int, int, int] = (4, 2, 2)  # sums to head_dim / 2; real (24, 20, 20)
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    # audio encoder (n_window as the processor's; n_window_infer: two chunks per window)
    audio_d_model: int = 16
    audio_layers: int = 1
    audio_heads: int = 2
    audio_ffn: int = 32
    audio_downsample: int = 8
    audio_n_window: int = 50
    audio_n_window_infer: int = 200
    # vision encoder (deepstack after blocks 0 and 1: injected after thinker layers 0 and 1)
    vision_depth: int = 3
    vision_hidden: int = 16
    vision_heads: int = 2
    vision_intermediate: int = 32
    vision_patch_size: int = 16
    vision_position_embeddings: int = 64  # an 8 x 8 learned grid, resampled per image
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    # talker (MoE with a shared expert; reads thinker hidden_states[accept_hidden_layer])
    accept_hidden_layer: int = 3  # real 24 of 48: a middle layer, past the deepstack ones
    codebook_size: int = 64
    talker_hidden_size: int = 32
    talker_intermediate_size: int = 64  # the text/hidden projections' inner width
    talker_num_layers: int = 2
    talker_num_heads: int = 4
    talker_num_kv_heads: int = 2
    talker_head_dim: int = 16
    talker_num_experts: int = 4
    talker_num_experts_per_tok: int = 2
    talker_moe_intermediate_size: int = 16
    talker_shared_expert_intermediate_size: int = 32
    talker_mrope_section: tuple[int, int, int] = (4, 2, 2)
    num_code_groups: int = 4  # real 16
    # code predictor (its width is the talker's: it reads the talker's hidden state)
    predictor_num_layers: int = 2
    predictor_num_heads: int = 4
    predictor_num_kv_heads: int = 2
    predictor_head_dim: int = 16
    predictor_intermediate_size: int = 64
    # code2wav (samples per frame = prod(upsample_rates) x prod(upsampling_ratios))
    code2wav_hidden_size: int = 32
    code2wav_intermediate_size: int = 64
    code2wav_num_layers: int = 2
    code2wav_num_heads: int = 4
    code2wav_sliding_window: int = 8  # real 72
    # 240 samples per frame (real 1920 = (8, 5, 4, 3) x (2, 2)): a 128-frame reply is 1.3 s
    # of 24 kHz audio, long enough to hear that speech works
    upsample_rates: tuple[int, ...] = (5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 32
    max_shard_size: str | None = "1MB"  # None: one model.safetensors

    @property
    def talker_vocab_size(self) -> int:
        """The codebook, then the block of specials transformers suppresses (see above)."""
        return self.codebook_size + SUPPRESSED_BLOCK

    @property
    def codec_ids(self) -> dict[str, int]:
        """Every codec special id, by its config name."""
        return {name: self.codebook_size + off for name, off in CODEC_OFFSETS.items()}

    @property
    def speaker_ids(self) -> dict[str, int]:
        """The voices' codec ids (lower-case names, as the real ``speaker_id`` map)."""
        return {name: self.codebook_size + off for name, off in VOICE_OFFSETS.items()}

    @property
    def samples_per_frame(self) -> int:
        """code2wav's ``total_upsample``: waveform samples per talker frame."""
        total = 1
        for rate in (*self.upsample_rates, *self.upsampling_ratios):
            total *= rate
        return total


DEFAULT = TinyQwen3OmniSpec()
TINY_QWEN3_OMNI_SPECS: dict[str, TinyQwen3OmniSpec] = {"default": DEFAULT}
