"""The ways a trainer's tensors reach a stage, one class each (``stage/weights/transports.py``):
picked by the backend's name, each saying what it allows and what a failure costs; the
``staged`` one checks the staging in place and refuses a non-finite tensor naming it."""

from __future__ import annotations

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl.protocol import UpdateInfo
from omnistage.stage.weights.transports import (
    STAGED,
    IpcTransport,
    NcclTransport,
    transport_for,
)

CPU = torch.device("cpu")


def test_each_backend_has_its_transport():
    group = object()
    nccl = transport_for("nccl", group)
    assert isinstance(nccl, NcclTransport) and nccl.group is group
    assert nccl.lost_on_error and not nccl.shares_staging
    assert nccl.uses_gloo(CPU) and not nccl.uses_gloo(torch.device("cuda", 0))
    ipc = transport_for("ipc")
    assert isinstance(ipc, IpcTransport) and ipc.shares_staging and not ipc.lost_on_error
    assert not ipc.uses_gloo(CPU)
    with pytest.raises(ValueError, match="'carrier-pigeon'"):
        transport_for("carrier-pigeon")


def test_the_staged_transport_checks_the_staging_in_place():
    info = UpdateInfo.from_json(
        {"names": ["a", "b"], "dtype_names": ["float32"] * 2, "shapes": [[2], [2]], "staged": True}
    )
    good, bad = torch.ones(2), torch.tensor([1.0, float("nan")])
    STAGED.receive([("a", good), ("b", good)], info, CPU)
    with pytest.raises(InvalidRequestError, match="b"):
        STAGED.receive([("a", good), ("b", bad)], info, CPU)
