"""New weights for the offline ``LLM`` from a trainer in the same process, and the Python
wording of the errors the engine words for the server.

``InProcessWeights.apply`` is the in-process twin of a weight sync (``omnistage.rl``): the
trainer's tensors are checked as a sync checks them (names, shapes, dtypes, finite values),
staged in host memory, then copied into the live weights in place, all or nothing, under a
``weight_version``. The host copy is what a level-2 reload replays (the trainer's own tensors
change with its next step); its buffers are reused from one update to the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

import torch

from omnistage.errors import InvalidRequestError
from omnistage.rl.bounds import check_weight_version
from omnistage.rl.protocol import UpdateInfo, dtype_name
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.control import Ack
from omnistage.stage.weights.checks import check_tensors, copy_checked, copy_into

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
E = TypeVar("E", bound=BaseException)


def reworded(exc: E, message: str) -> E:
    """``exc`` (same class and attributes) with ``message``: an error the engine words for
    the server (a flag, a route) reworded for a Python caller (a keyword, a method)."""
    new = type(exc).__new__(type(exc))
    new.__dict__.update(exc.__dict__)
    new.args = (message,)
    return new


class InProcessWeights:
    """Applies a trainer's tensors to one engine's weights (see the module docstring)."""

    def __init__(self, engine: ARStageEngine) -> None:
        self.engine = engine
        self._live: dict[str, torch.Tensor] = {}  # host copies a reload may replay
        self._spare: dict[str, torch.Tensor] = {}  # host buffers to stage the next update in

    def apply(
        self,
        weights: NamedTensors,
        weight_version: str | int | None,
        *,
        check_finite: bool = True,
        convert_dtypes: bool = False,
    ) -> Ack:
        """Check, stage and apply ``weights`` (a state dict, or ``(name, tensor)`` pairs);
        ``InvalidRequestError`` naming ``weights.<name>`` (or ``weight_version``) before
        anything changes."""
        version = "" if weight_version is None else check_weight_version(weight_version)
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        if not pairs:
            raise InvalidRequestError("weights", "carried no tensors")
        names = [name for name, _ in pairs]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise InvalidRequestError(f"weights.{twice}", "appears twice")
        bad = next((n for n, t in pairs if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            raise InvalidRequestError(f"weights.{bad}", "must be a torch.Tensor")
        info = UpdateInfo(
            names,
            [dtype_name(t.dtype) for _, t in pairs],
            [list(t.shape) for _, t in pairs],
            convert_dtypes=convert_dtypes,
        )
        try:
            check_tensors(info, self.engine.worker.weight_targets(), None, gloo=False)
        except InvalidRequestError as exc:  # named as this call has them
            field = exc.field
            for part in ("update_info.dtype_names.", "update_info.shapes.", "update_info.names."):
                field = field.replace(part, "weights.")
            reason = exc.reason.replace(
                "set update_info.convert_dtypes: true", "pass convert_dtypes=True"
            )
            raise type(exc)(field, reason) from None
        except ValueError as exc:  # a dtype no weight has (complex, ...)
            raise InvalidRequestError("weights", str(exc)) from None
        staged: dict[str, torch.Tensor] = {}
        try:
            for name, tensor in pairs:
                staged[name] = host = self._buffer(name, tensor)
                source = tensor.detach()
                if not check_finite:
                    copy_into(host, source)
                elif not copy_checked(host, source.contiguous()):  # one pass: copy and check
                    raise InvalidRequestError(f"weights.{name}", "has NaN or infinite values")
            ack: Ack = self.engine._apply_synced(staged, version)
        except BaseException:
            self._spare.update(staged)
            raise
        # The update replaced the whole history (it carried every weight): the host copies
        # before it are nobody's reload source any more, and stage the next update.
        if ack.metadata.weight_sources is not None and len(ack.metadata.weight_sources) == 1:
            self._spare.update(self._live)
            self._live = {}
        self._live.update(staged)
        return ack

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        spare = self._spare.pop(name, None)
        if spare is not None and spare.dtype == like.dtype and spare.shape == like.shape:
            return spare
        pinned = self.engine.device.type == "cuda"
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
