"""Every wire struct survives encode/decode unchanged, tensors included; bad payloads are
refused by the decoder, not carried."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage import control as ops
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import ARStageInfo, ARStageRequest, MultiModalItem
from omnistage.stage.control import make_ack
from omnistage.stage.diffusion.params import DiffusionParams, ImageOutput, PipelineLimits
from omnistage.stage.diffusion.wire import DiffusionStageInfo, DiffusionStageRequest
from omnistage.stage.messages import (
    AbortRequest,
    AddRequest,
    ControlCall,
    ControlResult,
    Heartbeat,
    OutputBatch,
    OutputMessage,
    Ready,
    Shutdown,
    StartupOptions,
    TokenLogprobs,
    WireError,
    decode_from_stage,
    decode_startup,
    decode_to_stage,
    encode,
    encode_startup,
)

LIMITS = PipelineLimits(size_multiple=16, embedding_dim=4, has_text_encoder=False)
TO_STAGE = [
    AddRequest(
        "a",
        ARStageRequest([1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=2**63), True),
    ),
    AddRequest(
        "d",
        DiffusionStageRequest(
            prompt_embeds=torch.randn(3, 4),
            negative_prompt_embeds=torch.zeros(1, 4, dtype=torch.bfloat16),
            params=DiffusionParams(seed=3, height=32),
        ),
    ),
    AddRequest(
        "m",
        ARStageRequest(
            [1, 9, 9, 9, 2],
            multi_modal=[
                MultiModalItem("embeds", 1, 3, {"embeds": torch.randn(3, 8)}, "sha256:ab")
            ],
        ),
    ),
    AbortRequest(["a", "d"]),
    ControlCall(7, ops.Sleep(level=1, mode="keep", tags=["weights"])),
    ControlCall(8, ops.WakeUp(tags=None, reload=False)),
    ControlCall(9, ops.UpdateWeights(path="/x.safetensors", check_finite=False)),
    ControlCall(10, ops.FinishWeightUpdate(weight_version="v1")),
    Shutdown(),
]
FROM_STAGE = [
    ControlResult(1, acks=[make_ack(0, freed_bytes=5, level=1, tags=["weights"])]),
    ControlResult(2, value={"is_sleeping": False, "memory": {"resident_bytes": 3}}),
    ControlResult(3, error=WireError("InvalidRequestError", "level: bad", "level")),
    OutputBatch(
        [
            OutputMessage(
                "a",
                text_delta="hi",
                new_token_ids=[5],
                finished=True,
                finish_reason="stop",
                hidden_states=torch.randn(4, 8),
                logprobs=[TokenLogprobs([5, 7], [-0.5, -0.1], [2, 1], ["a", "b"])],
                prompt_logprobs=[None, TokenLogprobs([3], [-1.0], [4], ["c"])],
            ),
            OutputMessage("d", finished=True, media=[ImageOutput(b"\x89PNG", 8, 8, 3)]),
        ]
    ),
    Ready(0, "ar", 123, ARStageInfo(vocab_size=512, max_model_len=64)),
    Ready(1, "diffusion", 124, DiffusionStageInfo(limits=LIMITS)),
    Heartbeat(0),
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("msg", TO_STAGE, ids=lambda m: type(m).__name__)
def test_messages_to_a_stage_round_trip(msg):
    assert _same(decode_to_stage(encode(msg)), msg)


@pytest.mark.parametrize("msg", FROM_STAGE, ids=lambda m: type(m).__name__)
def test_messages_from_a_stage_round_trip(msg):
    assert _same(decode_from_stage(encode(msg)), msg)


def test_startup_options_round_trip():
    options = StartupOptions(sleep_level=2, paused=True, weight_sources=["/ckpt", "/upd.st"])
    assert decode_startup(encode_startup(options)) == options


def test_the_decoder_revalidates_sampling_params():
    raw = msgspec.msgpack.encode(
        {"type": "AddRequest", "request_id": "x",
         "request": {"type": "ar", "prompt_token_ids": [1], "sampling_params": {"top_p": 0.0}}}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        decode_to_stage(raw)


def test_control_operations_are_checked_where_they_are_made_and_again_when_decoded():
    with pytest.raises(InvalidRequestError) as made:
        ops.Sleep(level=7)
    assert (
        made.value.field == "level" and str(made.value) == "level: must be one of [0, 1, 2], got 7"
    )
    raw = msgspec.msgpack.encode(
        {"type": "ControlCall", "call_id": 1, "op": {"type": "Sleep", "level": 7}}
    )
    with pytest.raises(msgspec.ValidationError, match="level"):
        decode_to_stage(raw)
    with pytest.raises(InvalidRequestError, match="mode"):
        ops.Pause(mode="later")
    with pytest.raises(InvalidRequestError, match="tags"):
        ops.WakeUp(tags=[])


def test_an_ack_leaves_a_stage_as_one_ack_per_rank():
    ack = make_ack(0, level=1)
    ack.rank_acks = [make_ack(0, rank=1, level=1)]
    assert [a.rank for a in ack.flat()] == [0, 1]
    assert all(a.rank_acks == [] for a in ack.flat())
    assert "rank_acks" not in ack.to_dict()


def test_unknown_request_fields_are_refused_by_the_decoder():
    raw = msgspec.msgpack.encode(
        {"type": "AddRequest", "request_id": "x",
         "request": {"type": "ar", "prompt_token_ids": [1], "colour": "red"}}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="colour"):
        decode_to_stage(raw)
