"""The trainer's side: ``WeightSender`` holds its update in a session (ids passed back on
update and finish, its own session aborted when it fails half-way) and checks the bounds
before anything moves; the protocol's parsers name the field of every bad value."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl import WeightSender, WeightSyncError
from omnistage.rl.bounds import check_timeout, check_weight_version
from omnistage.rl.protocol import InitInfo, UpdateInfo

STATE = {"a": torch.ones(2, 3), "b": torch.zeros(4)}


class FakeStage:
    """The HTTP side of a stage, recording what the sender asked."""

    def __init__(self, fail_update: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_update = fail_update

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        self.calls.append((path, body))
        if path.endswith("/start"):
            return httpx.Response(200, json={"started": True, "session": "s-1"})
        if path.endswith("/update"):
            if self.fail_update:
                return httpx.Response(502, json={"detail": "the transfer broke"})
            return httpx.Response(200, json={"received_tensors": 1, "received_bytes": 8})
        if path.endswith("/finish"):
            ack = {"status": "SUCCESS", "metadata": {"weight_version": body["weight_version"]}}
            return httpx.Response(200, json={"status": "SUCCESS", "acks": [ack]})
        return httpx.Response(200, json={"aborted": True})


def sender_for(stage: FakeStage, **kwargs: Any) -> WeightSender:
    sender = WeightSender("http://stage", backend="ipc", chunk_bytes=16, **kwargs)
    sender._http = httpx.Client(base_url="http://stage", transport=httpx.MockTransport(stage))
    return sender


def test_send_holds_its_update_in_a_session():
    stage = FakeStage()
    with sender_for(stage) as sender:
        ack = sender.send(STATE.items(), weight_version=3)
    assert ack["metadata"]["weight_version"] == 3
    paths = [path for path, _ in stage.calls]
    assert paths[0].endswith("/start") and paths[-1].endswith("/finish")
    start = stage.calls[0][1]
    assert start["require_session"] is True and start["abort_open"] is False
    assert start["update_info"]["names"] == ["a", "b"]
    assert all(body["session"] == "s-1" for _, body in stage.calls[1:])


def test_a_send_that_fails_half_way_aborts_its_own_session():
    stage = FakeStage(fail_update=True)
    with sender_for(stage) as sender, pytest.raises(WeightSyncError, match="502"):
        sender.send(STATE.items(), weight_version="v")
    path, body = stage.calls[-1]
    assert path.endswith("/abort") and body["session"] == "s-1"


def test_bounds_are_checked_before_anything_moves():
    stage = FakeStage()
    with sender_for(stage) as sender, pytest.raises(ValueError, match="weight_version"):
        sender.send(STATE.items(), weight_version="x" * 129)
    assert stage.calls == []
    with pytest.raises(ValueError, match="timeout_s"):
        WeightSender("http://stage", timeout_s=601)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightSender("http://stage", timeout_s=0)


@pytest.mark.parametrize("value", ["0", "step-12", "v1.2:3+rc_4", 7, -1, "x" * 128])
def test_plain_versions_pass(value):
    assert check_weight_version(value) == str(value)


@pytest.mark.parametrize("value", ["", "a b", "x" * 129, "x" * 4_000_000, 10**130, True, 1.5])
def test_other_versions_are_refused_without_echoing_them(value):
    with pytest.raises(InvalidRequestError) as bad:
        check_weight_version(value)
    assert bad.value.field == "weight_version" and len(str(bad.value)) < 120


@pytest.mark.parametrize("value", [0, -1, 601, float("nan"), float("inf"), "10", None, True])
def test_a_timeout_is_in_range(value):
    with pytest.raises(InvalidRequestError):
        check_timeout(value)
    assert check_timeout(600) == 600.0


def test_init_info_defaults_and_field_names():
    info = InitInfo.from_json({"master_address": "10.0.0.1", "master_port": "29500"})
    assert (info.master_port, info.world_size, info.rank_offset, info.timeout_s) == (
        29500, 2, 1, 60.0,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError) as bad:
        InitInfo.from_json({"master_address": "h", "master_port": True})
    assert bad.value.field == "init_info.master_port"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], "update_info"),
        ({"names": ["a"], "dtype_names": ["float33"], "shapes": [[1]]}, "update_info.dtype_names.a"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]}, "update_info.shapes.a"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "convert_dtypes": 1},
         "update_info.convert_dtypes"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "ipc_handles": [{}]},
         "update_info.ipc_handles"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]],
          "ipc_handles": [{"shm": "x", "offset": -4}]}, "update_info.ipc_handles"),
    ],
)  # fmt: skip
def test_update_info_names_the_bad_field(data, field):
    with pytest.raises(InvalidRequestError) as bad:
        UpdateInfo.from_json(data)
    assert bad.value.field == field
