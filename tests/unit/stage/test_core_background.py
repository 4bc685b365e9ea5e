"""``StageCore`` with a control call whose work runs on a thread (a weight receive): the
stage keeps serving requests, calls that change no memory or weights answer at once, and
sleep, wake and a sync's finish wait for the work and are then answered in order."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from omnistage.stage import control as ops
from omnistage.stage.ar.wire import ARStageRequest
from omnistage.stage.background import Background
from omnistage.stage.core import StageCore
from omnistage.stage.messages import AddRequest, ControlCall, ControlResult, OutputBatch
from tests.unit.stage.ar.helpers import build_micro, greedy, make_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(build_micro(tmp_path_factory.mktemp("micro")))


def gated(release: threading.Event) -> Background[Any]:
    """A receive that ends when the test says so (a trainer that stalls, then sends)."""
    return Background(
        "receive", lambda: release.wait(30), lambda value, error: {"received": value}
    ).start()


def run_until(core: StageCore, call_ids: set[int], timeout_s: float = 30.0) -> list[Any]:
    """Step the core (as its loop does) until every call in ``call_ids`` is answered."""
    replies: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not call_ids <= {r.call_id for r in replies if isinstance(r, ControlResult)}:
        assert time.monotonic() < deadline, replies
        replies.extend(core.step())
        time.sleep(0.001)
    return replies


def test_sleep_wake_and_finish_wait_for_a_receive_while_requests_are_served(engine, monkeypatch):
    core = StageCore(engine)
    release = threading.Event()
    monkeypatch.setattr(engine.weight_sync, "receive_weights", lambda info, session: gated(release))

    assert core.handle(ControlCall(1, ops.ReceiveWeights(update_info={}))) == []
    assert core.handle(ControlCall(2, ops.Sleep(level=1))) == []  # held
    assert core.handle(ControlCall(3, ops.WakeUp())) == []  # held, behind the sleep
    (status,) = core.handle(ControlCall(4, ops.Status()))  # answers at once
    assert isinstance(status, ControlResult) and status.error is None
    assert core.has_work()

    # The stage serves while the receive waits on its trainer.
    request = ARStageRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(4))
    assert core.handle(AddRequest("r", request)) == []
    outputs: list[Any] = []
    deadline = time.monotonic() + 30
    while not any(o.finished for batch in outputs for o in batch.outputs):
        assert time.monotonic() < deadline
        replies = core.step()
        assert not [r for r in replies if isinstance(r, ControlResult)]  # nothing answered
        outputs.extend(r for r in replies if isinstance(r, OutputBatch))
    assert not engine.is_sleeping()

    release.set()
    answered = [r for r in run_until(core, {1, 2, 3}) if isinstance(r, ControlResult)]
    assert [r.call_id for r in answered] == [1, 2, 3]  # the receive, then the held, in order
    assert answered[0].value == {"received": True}
    assert answered[1].acks is not None and answered[1].acks[0].status == "SUCCESS"
    assert answered[2].acks is not None and answered[2].acks[0].status == "SUCCESS"
    assert not core.has_work() and not engine.is_sleeping()
    engine.resume()


def test_a_failed_background_call_is_answered_with_its_error(engine, monkeypatch):
    core = StageCore(engine)

    def broken(info: Any, session: Any) -> Background[Any]:
        def settle(value: Any, error: BaseException | None) -> Any:
            raise ValueError(f"settled: {error}")

        return Background("receive", lambda: 1 / 0, settle).start()

    monkeypatch.setattr(engine.weight_sync, "receive_weights", broken)
    assert core.handle(ControlCall(7, ops.ReceiveWeights(update_info={}))) == []
    (reply,) = [r for r in run_until(core, {7}) if isinstance(r, ControlResult)]
    assert reply.error is not None and reply.error.type == "ValueError"
    assert reply.error.message == "settled: division by zero"
