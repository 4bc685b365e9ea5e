"""Hand-offs between stages: a payload left in shared memory or served from a socket is
taken once by the next stage, whole; an abandoned or aborted one is discarded; the processor
runs in the stage that takes it."""

from __future__ import annotations

import os

import pytest
import torch

from omnistage.errors import StageInternalError
from omnistage.stage.diffusion.wire import DiffusionStageRequest
from omnistage.stage.handoff import (
    Handoffs,
    SharedMemoryTransport,
    SocketTransport,
    take,
)
from omnistage.stage.messages import Handoff, Upstream
from omnistage.stage.types import StageOutput


def payload() -> Handoff:
    return Handoff(
        text="a red square",
        token_ids=[5, 6, 7],
        hidden_states=torch.randn(4, 8),
        token_embeddings=torch.randn(3, 8, dtype=torch.float16),
        num_prompt_tokens=1,
    )


def assert_same(got: Handoff, want: Handoff) -> None:
    assert (got.text, got.token_ids, got.num_prompt_tokens) == (
        want.text, want.token_ids, want.num_prompt_tokens,
    )  # fmt: skip
    assert torch.equal(got.hidden_states, want.hidden_states)
    assert torch.equal(got.token_embeddings, want.token_embeddings)


def test_shared_memory_is_taken_once_and_then_gone():
    transport = SharedMemoryTransport()
    want = payload()
    ref = transport.put(want)
    assert os.path.exists(f"/dev/shm/{ref.key}")
    assert_same(take(ref), want)
    assert not os.path.exists(f"/dev/shm/{ref.key}")
    with pytest.raises(StageInternalError, match="gone"):
        take(ref)


def test_a_discarded_segment_is_gone():
    transport = SharedMemoryTransport()
    ref = transport.put(payload())
    transport.discard(ref)
    transport.discard(ref)  # twice: nothing left, nothing raised
    assert not os.path.exists(f"/dev/shm/{ref.key}")


def test_a_socket_serves_a_payload_once():
    transport = SocketTransport("127.0.0.1")
    try:
        want = payload()
        ref = transport.put(want)
        assert ref.address.startswith("tcp://127.0.0.1:")
        assert_same(take(ref), want)
        with pytest.raises(StageInternalError, match="gone"):
            take(ref)
    finally:
        transport.close()


def test_a_forwarded_request_is_gathered_and_left_when_it_ends():
    handoffs = Handoffs(SharedMemoryTransport(), "/unused")
    handoffs.forward("r")
    assert handoffs.observe(StageOutput("r", text_delta="a ", new_token_ids=[1])) is None
    ref = handoffs.observe(
        StageOutput(
            "r", text_delta="cat", new_token_ids=[2], finished=True, finish_reason="stop",
            num_prompt_tokens=3, handoff={"hidden_states": torch.ones(5, 2)},
        )
    )  # fmt: skip
    assert ref is not None
    got = take(ref)
    assert (got.text, got.token_ids, got.num_prompt_tokens) == ("a cat", [1, 2], 3)
    assert torch.equal(got.hidden_states, torch.ones(5, 2))
    assert handoffs.observe(StageOutput("other", finished=True, finish_reason="stop")) is None


def test_an_aborted_request_leaves_nothing_and_an_abort_after_the_end_discards():
    handoffs = Handoffs(SharedMemoryTransport(), "/unused")
    handoffs.forward("gone")
    assert handoffs.observe(StageOutput("gone", finished=True, finish_reason="abort")) is None
    handoffs.forward("late")
    ref = handoffs.observe(StageOutput("late", finished=True, finish_reason="stop"))
    assert ref is not None and os.path.exists(f"/dev/shm/{ref.key}")
    handoffs.aborted("late")  # its end never reached the API process
    assert not os.path.exists(f"/dev/shm/{ref.key}")


def test_the_stage_that_takes_a_payload_runs_the_processor_on_it():
    transport = SharedMemoryTransport()
    ref = transport.put(Handoff(text="a red square"))
    handoffs = Handoffs(transport, "/unused")
    filled = handoffs.resolve(DiffusionStageRequest(), Upstream(ref, "text_to_image_prompt"))
    assert filled.prompt == "a red square"
