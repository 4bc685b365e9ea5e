"""``WeightSync`` alone, on CPU: update sessions (one owner, 409 for anyone else, abort),
the checks made before any byte moves (names, shapes, dtypes, handles), an update applied
only when every announced tensor arrived, and the receive and the rendezvous running on a
thread — over shared memory (``ipc``) and a real gloo group with a trainer thread."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnistage.errors import ConflictError, InvalidRequestError, WeightTransferError
from omnistage.rl.protocol import UpdateInfo, weights_checksum
from omnistage.stage.background import Background, run_to_answer
from omnistage.stage.control import make_ack
from omnistage.stage.weights.checks import check_tensors
from omnistage.stage.weights.sync import WeightSync
from tests.unit.stage.shared_tensors import Shared, describe


@pytest.fixture
def shared() -> Iterator[Shared]:
    s = Shared()
    yield s
    s.close()


class Stage:
    """A worker's weights and what applying a sync does to them (copy in place)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.randn(3, generator=g),
            "steps": torch.arange(5),
        }
        self.version: str | None = None
        self.sync = WeightSync(0, lambda: self.weights, self._apply, torch.device("cpu"))

    def _apply(self, tensors: dict[str, torch.Tensor], version: str) -> Any:
        for name, tensor in tensors.items():
            self.weights[name].copy_(tensor)
        self.version = version
        return make_ack(0, weight_sources=[f"sync:{version}"], weight_version=version)

    def checksum(self) -> str:
        return weights_checksum(self.weights.items())

    def new_weights(self, seed: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [
            (n, torch.randn(t.shape, generator=g) if t.is_floating_point() else t + seed)
            for n, t in self.weights.items()
        ]


@pytest.fixture
def stage() -> Stage:
    s = Stage()
    s.sync.init_weight_transfer("ipc")
    return s


def start(stage: Stage, *args: Any, **kwargs: Any) -> Any:
    """``start_weight_update``, its answer once a new staging set is made (on a thread)."""
    return run_to_answer(stage.sync.start_weight_update(*args, **kwargs))


def receive(stage: Stage, info: dict[str, Any], session: str | None = None) -> Any:
    return run_to_answer(stage.sync.receive_weights(info, session))


def field_of(info: pytest.ExceptionInfo[Exception]) -> str:
    return str(info.value.field)  # type: ignore[attr-defined]


# -- sessions --------------------------------------------------------------------------------


def test_a_session_belongs_to_its_starter_until_it_finishes(stage, shared):
    new = stage.new_weights(1)
    before = stage.checksum()
    sid = start(stage, describe(new), require_session=True)["session"]
    receive(stage, shared.chunk(new[:1]), sid)
    with pytest.raises(ConflictError) as second:
        start(stage)  # another trainer
    assert field_of(second) == "session" and sid not in str(second.value)  # never leaks the id
    for session in (None, "forged"):
        with pytest.raises(ConflictError):
            receive(stage, shared.chunk(new[1:]), session)
        with pytest.raises(ConflictError):
            stage.sync.finish_weight_update("mine", session)
        with pytest.raises(ConflictError):
            stage.sync.abort_weight_update(session)
    assert stage.checksum() == before and stage.version is None
    receive(stage, shared.chunk(new[1:]), sid)  # the owner goes on, untouched by the refusals
    ack = stage.sync.finish_weight_update("v1", sid)
    assert ack.status == "SUCCESS" and stage.version == "v1"
    assert stage.checksum() == weights_checksum(new)
    with pytest.raises(ConflictError) as ended:
        receive(stage, shared.chunk(new[:1]), sid)
    assert "names no open" in str(ended.value)
    with pytest.raises(InvalidRequestError):
        receive(stage, shared.chunk(new[:1]))  # no session at all: start first (400)


def test_a_session_started_without_asking_for_an_id_goes_on_without_one(stage, shared):
    new = stage.new_weights(2)
    reply = start(stage)
    assert reply["started"] and reply["session"]
    receive(stage, shared.chunk(new))
    with pytest.raises(ConflictError):
        start(stage)  # a second start is a conflict either way
    with pytest.raises(ConflictError):
        stage.sync.finish_weight_update("v2", "forged")  # a wrong id is one too
    assert stage.sync.finish_weight_update("v2").status == "SUCCESS"
    assert stage.checksum() == weights_checksum(new)


def test_abort_open_takes_over_and_the_old_owner_is_refused(stage, shared):
    old, new = stage.new_weights(3), stage.new_weights(4)
    before = stage.checksum()
    first = start(stage, require_session=True)["session"]
    receive(stage, shared.chunk(old[:2]), first)
    with pytest.raises(InvalidRequestError):  # a bad announcement aborts nothing
        start(
            stage, {"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]}, abort_open=True
        )
    second = start(stage, require_session=True, abort_open=True)["session"]
    with pytest.raises(ConflictError):
        stage.sync.finish_weight_update("old", first)
    assert stage.checksum() == before
    receive(stage, shared.chunk(new), second)
    stage.sync.finish_weight_update("new", second)
    assert stage.checksum() == weights_checksum(new) and stage.version == "new"


def test_the_owner_may_abort_its_session(stage, shared):
    before = stage.checksum()
    sid = start(stage, require_session=True)["session"]
    receive(stage, shared.chunk(stage.new_weights(5)), sid)
    assert stage.sync.abort_weight_update(sid) == {"aborted": True}
    assert stage.checksum() == before
    start(stage)  # the next one starts


# -- what is checked before anything moves ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "float16", "float8_e4m3fn"])
def test_a_declared_dtype_must_be_the_weights_own(stage, shared, dtype):
    before = stage.checksum()
    bad = [("w", torch.zeros(4, 3).to(getattr(torch, dtype)))]
    with pytest.raises(InvalidRequestError) as announced:
        start(stage, describe(bad))
    assert field_of(announced) == "update_info.dtype_names.w"
    assert dtype in str(announced.value) and "float32" in str(announced.value)
    start(stage)
    with pytest.raises(InvalidRequestError) as chunk:
        receive(stage, shared.chunk(bad))
    assert field_of(chunk) == "update_info.dtype_names.w"
    with pytest.raises(InvalidRequestError):  # the refused chunk ended the session
        stage.sync.finish_weight_update("bad")
    assert stage.checksum() == before and stage.version is None


def test_convert_dtypes_casts_between_floats_only(stage, shared):
    half = [("w", torch.full((4, 3), 0.5, dtype=torch.float16))]
    start(stage)
    receive(stage, shared.chunk(half, convert_dtypes=True))
    stage.sync.finish_weight_update("half")
    assert stage.weights["w"].dtype == torch.float32 and bool((stage.weights["w"] == 0.5).all())
    start(stage)
    with pytest.raises(InvalidRequestError):
        receive(
            stage, shared.chunk([("w", torch.ones(4, 3, dtype=torch.int8))], convert_dtypes=True)
        )


def test_gloo_refuses_what_it_cannot_carry_before_the_broadcast():
    weights = {"q": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    info = UpdateInfo.from_json(describe(list(weights.items())))
    with pytest.raises(InvalidRequestError) as gloo:
        check_tensors(info, weights, None, gloo=True)
    assert "gloo" in str(gloo.value)
    assert check_tensors(info, weights, None, gloo=False) == {"q": (torch.float8_e4m3fn, [2])}


def test_handles_must_fit_the_backend_and_the_device(stage):
    start(stage)
    cuda = {"cuda": {"device": 0, "handle": ""}}
    with pytest.raises(InvalidRequestError) as on_cpu:
        receive(stage, describe([("b", torch.zeros(3))], ipc_handles=[cuda]))
    assert field_of(on_cpu) == "update_info.ipc_handles" and "cpu" in str(on_cpu.value)
    start(stage)
    with pytest.raises(InvalidRequestError) as none:
        receive(stage, describe([("b", torch.zeros(3))]))
    assert "needs handles" in str(none.value)


def test_values_that_are_not_finite_end_the_update(stage, shared):
    before = stage.checksum()
    start(stage)
    with pytest.raises(InvalidRequestError) as nan:
        receive(stage, shared.chunk([("b", torch.tensor([0.0, float("nan"), 1.0]))]))
    assert field_of(nan) == "update_info.names.b"
    assert stage.checksum() == before


def test_a_partial_update_is_refused_and_the_old_weights_stay(stage, shared):
    new = stage.new_weights(6)
    before = stage.checksum()
    sid = start(stage, describe(new), require_session=True)["session"]
    receive(stage, shared.chunk(new[:1]), sid)
    with pytest.raises(InvalidRequestError) as missing:
        stage.sync.finish_weight_update("partial", sid)
    assert field_of(missing) == "update_info.names"
    assert "2 of the 3" in str(missing.value) and "'b'" in str(missing.value)
    assert stage.checksum() == before and stage.version is None
    start(stage)  # that session is over


def test_a_chunk_may_not_repeat_or_stray_from_the_announcement(stage, shared):
    new = stage.new_weights(7)
    start(stage, describe(new[:2]))
    receive(stage, shared.chunk(new[:1]))
    with pytest.raises(InvalidRequestError, match="arrived twice"):
        receive(stage, shared.chunk(new[:1]))
    start(stage, describe(new[:2]))
    with pytest.raises(InvalidRequestError, match="not announced"):
        receive(stage, shared.chunk(new[2:]))


@pytest.mark.parametrize("version", ["x" * 129, "has space", "", "semi;colon", "ünï", 10**200])
def test_a_weight_version_is_short_and_plain(stage, shared, version):
    start(stage)
    receive(stage, shared.chunk(stage.new_weights(8)))
    with pytest.raises(InvalidRequestError) as bad:
        stage.sync.finish_weight_update(version)  # type: ignore[arg-type]
    assert field_of(bad) == "weight_version" and len(str(bad.value)) < 200
    assert stage.sync.finish_weight_update("ok-1.2:3+4").status == "SUCCESS"  # still open


# -- the transfer runs on a thread -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    """Rank 0 of a gloo group with the stage, on a thread of the test."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        import torch.distributed as dist

        self.port = free_port()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, 2, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self.group: Any = None
        self._joined = threading.Thread(target=self._join, daemon=True)
        self._joined.start()

    def _join(self) -> None:
        import torch.distributed as dist

        self.group = dist.ProcessGroupGloo(self.store, 0, 2, self.timeout)

    def init_info(self, timeout_s: float) -> dict[str, Any]:
        return {"master_address": "127.0.0.1", "master_port": self.port, "timeout_s": timeout_s}

    def joined(self) -> None:
        self._joined.join(30)
        assert self.group is not None

    def broadcast(self, named: list[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _, tensor in named:
            self.group.broadcast([tensor.contiguous()], opts).wait()


def test_a_receive_runs_beside_the_caller_and_holds_off_other_transfer_calls():
    stage = Stage()
    trainer = Trainer()
    init = stage.sync.init_weight_transfer("nccl", trainer.init_info(timeout_s=30))
    assert isinstance(init, Background)
    assert run_to_answer(init) == {"backend": "nccl", "rank": 1}
    trainer.joined()
    new = stage.new_weights(9)
    sid = start(stage, describe(new), require_session=True)["session"]
    pending = stage.sync.receive_weights(describe(new), sid)
    assert isinstance(pending, Background)  # returned at once: the trainer has sent nothing
    assert not pending.wait(0.2)
    for call in (
        lambda: stage.sync.receive_weights(describe(new), sid),
        lambda: stage.sync.finish_weight_update("v", sid),
        lambda: start(stage, abort_open=True),
        lambda: stage.sync.init_weight_transfer("ipc", abort_open=True),
    ):
        with pytest.raises(ConflictError):
            call()
    assert stage.checksum() != weights_checksum(new)  # the old weights serve meanwhile
    trainer.broadcast(new)
    assert run_to_answer(pending)["received_tensors"] == 3
    stage.sync.finish_weight_update("gloo", sid)
    assert stage.checksum() == weights_checksum(new)


def test_a_stalled_trainer_fails_the_update_after_its_timeout_and_nothing_changes():
    stage = Stage()
    trainer = Trainer()
    run_to_answer(stage.sync.init_weight_transfer("nccl", trainer.init_info(timeout_s=1)))
    trainer.joined()
    before = stage.checksum()
    start(stage)
    with pytest.raises(WeightTransferError):
        receive(stage, describe(stage.new_weights(10)))  # the trainer never broadcasts
    assert stage.checksum() == before
    assert stage.sync.backend is None  # a broken group is dropped: init again
    with pytest.raises(InvalidRequestError):
        start(stage)


def test_init_answers_at_once_and_a_trainer_that_is_not_there_fails_it_in_time():
    """A trainer's absence is the caller's problem (a 400 naming the rendezvous), told within
    a second of its timeout_s (torch's store alone takes 8.6 s for 5)."""
    stage = Stage()
    began = time.monotonic()
    init = stage.sync.init_weight_transfer(
        "nccl", {"master_address": "127.0.0.1", "master_port": free_port(), "timeout_s": 2}
    )
    assert isinstance(init, Background) and time.monotonic() - began < 1
    with pytest.raises(ConflictError):
        start(stage)  # still joining
    with pytest.raises(InvalidRequestError, match="no trainer joined the rendezvous at 127"):
        run_to_answer(init)
    assert time.monotonic() - began < 3
    assert stage.sync.backend is None


@pytest.mark.parametrize(
    ("init_info", "field"),
    [
        ({"master_port": 1234}, "init_info.master_address"),
        ({"master_address": "h", "master_port": 70000}, "init_info.master_port"),
        ({"master_address": "h", "master_port": 0}, "init_info.master_port"),
        ({"master_address": "h", "master_port": 1, "timeout_s": -1}, "init_info.timeout_s"),
        ({"master_address": "h", "master_port": 1, "timeout_s": 601}, "init_info.timeout_s"),
        ({"master_address": "h", "master_port": 1, "timeout_s": "x"}, "init_info.timeout_s"),
        ({"master_address": "h", "master_port": 1, "rank_offset": 2}, "init_info.rank_offset"),
        ({"master_address": "h", "master_port": 1, "world_size": 1}, "init_info.world_size"),
    ],
)
def test_a_bad_init_info_is_refused_and_the_transfer_stays(stage, init_info, field):
    with pytest.raises(InvalidRequestError) as bad:
        stage.sync.init_weight_transfer("nccl", init_info)
    assert field_of(bad) == field
    assert stage.sync.backend == "ipc"  # nothing was torn down
