"""Weights pushed by a trainer without disk — vLLM's weight-transfer protocol, for one worker.

``init_weight_transfer(backend, init_info)`` once: backend ``nccl`` joins a process group with
the trainer (NCCL on CUDA, gloo on CPU) as rank ``rank_offset`` of ``world_size``, the trainer
being rank 0; ``ipc`` (same host) needs nothing: tensors arrive as shared-memory segments on
CPU, CUDA IPC handles on GPU. Then per update ``start_weight_update`` → ``receive_weights``
(one or more chunks, described by names, dtypes and shapes) → ``finish_weight_update``.

An update is a *session* with an owner, so that two trainers can never mix their tensors
under one version: ``start`` answers a session id, ``update`` and ``finish`` name it. While
one is open, a second ``start`` (or ``init``) is a conflict (``ConflictError``, 409) unless
it says ``abort_open``, and an ``update``/``finish`` naming another session is one too. A
session started without ``require_session`` (vLLM's clients know no ids) may be continued
without its id; one started with it may not. Any failed ``update`` or ``finish`` ends the
session (start again), as does its owner's ``abort``; a refused conflict never touches it.

Tensors are staged in host memory as they arrive and checked (names, shapes and dtypes
against the live weights and what ``start`` announced, finite values); only ``finish``
copies them into the live weights, in place, and only when every announced tensor arrived.
A failed or interrupted update leaves the previous weights (and version) serving, and the
device never holds the weights twice. The host buffers are reused: the last update's
tensors stay as the level-2 reload source, the ones before them stage the next update (two
host copies at most, faulted in once).

The blocking parts — the ``nccl`` rendezvous of ``init`` and every chunk's receive — run on
a thread of the stage process (a ``Background`` the stage loop answers when it is done), so
the stage keeps serving on the old weights meanwhile; one runs at a time, and every wait
is bounded by the transfer's ``timeout_s``. ``finish`` (the in-place copy) runs on the loop.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnistage.errors import ConflictError, InvalidRequestError, WeightTransferError
from omnistage.rl.bounds import check_weight_version
from omnistage.rl.protocol import BACKENDS, InitInfo, UpdateInfo, weights_checksum
from omnistage.stage.background import Background
from omnistage.stage.weight_checks import Session, all_finite, check_handles, check_tensors
from omnistage.stage.weight_ipc import SharedSegments, from_ipc_handle

logger = logging.getLogger(__name__)

Targets = Callable[[], Mapping[str, torch.Tensor]]  # live weights by checkpoint name
Apply = Callable[[dict[str, torch.Tensor], str], Any]  # staged tensors, version -> ACK
MISSING_SHOWN = 8  # missing tensors a refused finish names


class WeightSync:
    def __init__(self, stage_id: int, targets: Targets, apply: Apply, device: torch.device) -> None:
        self.stage_id = stage_id
        self._targets = targets
        self._apply = apply
        self.device = device
        self.backend: str | None = None
        self._group: Any = None
        self._session: Session | None = None
        self._busy: str | None = None  # "init" or "receive" while its thread runs
        self._live: dict[str, torch.Tensor] = {}  # the last applied update's host tensors
        self._spare: dict[str, torch.Tensor] = {}  # host buffers to stage the next one in

    # -- init --------------------------------------------------------------------------

    def init_weight_transfer(
        self,
        backend: str = "nccl",
        init_info: dict[str, Any] | None = None,
        abort_open: bool = False,
    ) -> dict[str, Any] | Background[Any]:
        """Join the trainer: ``ipc`` at once; ``nccl`` answers once the trainer's rank 0 is
        there too (or the rendezvous timed out), the stage serving meanwhile."""
        if backend not in BACKENDS:
            raise InvalidRequestError(
                "backend", f"must be one of {list(BACKENDS)}, got {backend!r:.40}"
            )
        self._check_idle()
        self._check_takeover(abort_open)
        info = InitInfo.from_json(init_info or {}) if backend == "nccl" else None
        self._abort_open()
        self._group, self.backend = None, None  # the old group is not trusted across an init
        if info is None:
            self.backend = backend
            return {"backend": backend, "rank": 1}
        self._busy = "init"
        return Background(
            f"stage {self.stage_id}: join trainer",
            lambda: self._join(info),
            lambda group, error: self._joined(info, group, error),
        ).start()

    def _join(self, info: InitInfo) -> Any:
        """On the transfer's thread: the rendezvous and the group, bounded by timeout_s."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=info.timeout_s)
        store = dist.TCPStore(
            info.master_address, info.master_port, info.world_size, is_master=False,
            timeout=timeout,
        )  # fmt: skip
        if self.device.type == "cuda":  # never run on a GPU yet
            nccl = dist.ProcessGroupNCCL
            options = nccl.Options()
            options._timeout = timeout
            return nccl(store, info.rank_offset, info.world_size, options)
        return dist.ProcessGroupGloo(store, info.rank_offset, info.world_size, timeout)

    def _joined(self, info: InitInfo, group: Any, error: BaseException | None) -> dict[str, Any]:
        self._busy = None
        if error is not None:  # the trainer is not there: a failed init, not a dead stage
            raise WeightTransferError(
                f"could not join the trainer at {info.master_address}:{info.master_port}: "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
        self._group, self.backend = group, "nccl"
        return {"backend": "nccl", "rank": info.rank_offset}

    # -- sessions ----------------------------------------------------------------------

    def start_weight_update(
        self,
        update_info: dict[str, Any] | None = None,
        require_session: bool = False,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        """Open an update session. ``update_info`` may announce every tensor the update will
        carry: they are checked now, before any byte moves, so a trainer learns of a bad
        name, shape or dtype before it starts broadcasting (a collective the stage would
        not join) — and ``finish`` then refuses an update that did not carry them all."""
        self._check_idle()
        if self.backend is None:
            raise InvalidRequestError(
                "backend", "call init_weight_transfer (init_weight_transfer_engine) first"
            )
        self._check_takeover(abort_open)
        announced = None
        if update_info is not None:
            info = UpdateInfo.from_json(update_info)
            announced = check_tensors(info, self._targets(), None, gloo=self._gloo)
        self._abort_open()
        self._session = Session(secrets.token_hex(16), require_session, announced)
        return {"started": True, "session": self._session.id}

    @property
    def _gloo(self) -> bool:
        return self.backend == "nccl" and self.device.type != "cuda"

    def _check_idle(self) -> None:
        """One transfer call at a time (its thread owns the group and the staging)."""
        if self._busy == "init":
            raise ConflictError(
                "backend", "the transfer is still joining the trainer; retry once init answers"
            )
        if self._busy == "receive":
            raise ConflictError(
                "session", "a chunk is still being received; call again once its update answers"
            )

    def _check_takeover(self, abort_open: bool) -> None:
        if self._session is not None and not abort_open:
            raise ConflictError(
                "session",
                "another weight update session is open; finish it first, or pass "
                "abort_open: true to discard it",
            )

    def _abort_open(self) -> None:
        if self._session is not None:
            logger.warning("stage %d: weight update session aborted by a new one", self.stage_id)
            self._end(self._session)

    def _end(self, session: Session) -> None:
        """Close ``session``; what it staged becomes spare host buffers again."""
        self._spare.update(session.staged)
        session.staged = {}
        if self._session is session:
            self._session = None

    def _owned(self, session: str | None) -> Session:
        """The open session, if the caller may act on it (see the module docstring)."""
        current = self._session
        if current is None:
            if session is not None:
                raise ConflictError(
                    "session",
                    "names no open weight update session (it finished, was aborted, or ended "
                    "with a failed call); start a new one",
                )
            raise InvalidRequestError(
                "session", "no weight update in progress; call start_weight_update first"
            )
        if session is None:
            if current.required:
                raise ConflictError(
                    "session",
                    "the open weight update session requires its id (start's reply); pass it",
                )
            return current
        if not hmac.compare_digest(session.encode(), current.id.encode()):
            raise ConflictError(
                "session",
                "does not name the open weight update session (another caller's is open)",
            )
        return current

    # -- receive -----------------------------------------------------------------------

    def receive_weights(
        self, update_info: dict[str, Any], session: str | None = None
    ) -> Background[Any]:
        """Receive one chunk into host staging, on the transfer's thread. The description is
        checked here first; a bad one or a broken transfer ends the session (start again)."""
        self._check_idle()
        current = self._owned(session)
        try:
            info = UpdateInfo.from_json(update_info)
            specs = check_tensors(info, self._targets(), current, gloo=self._gloo)
            check_handles(info, self.backend, self.device)
        except InvalidRequestError:
            self._end(current)
            raise
        buffers = [self._buffer(name, *specs[name]) for name in info.names]
        group, backend = self._group, self.backend
        self._busy = "receive"
        return Background(
            f"stage {self.stage_id}: receive weights",
            lambda: self._transfer(info, buffers, group, backend),
            lambda received, error: self._received(current, info, buffers, received, error),
        ).start()

    def _buffer(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A host tensor to stage ``name`` in: a spare one of that shape, else a new one."""
        spare = self._spare.pop(name, None)
        if spare is not None and spare.dtype == dtype and list(spare.shape) == shape:
            return spare
        pinned = self.device.type == "cuda"
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def _transfer(
        self, info: UpdateInfo, buffers: list[torch.Tensor], group: Any, backend: str | None
    ) -> int:
        """On the transfer's thread: fill ``buffers`` (only they, and the group, are used
        here); the bytes received."""
        segments = SharedSegments()
        try:
            for i, (name, host) in enumerate(zip(info.names, buffers, strict=True)):
                if backend == "nccl":
                    self._broadcast_into(group, host)
                else:
                    assert info.ipc_handles is not None  # checked on the loop
                    from_ipc_handle(info.ipc_handles[i], host, segments)
                if not all_finite(host):
                    raise InvalidRequestError(
                        f"update_info.names.{name}", "has NaN or infinite values"
                    )
        finally:
            segments.close()
        return sum(t.numel() * t.element_size() for t in buffers)

    def _broadcast_into(self, group: Any, host: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.device.type != "cuda":  # gloo receives straight into host memory
            group.broadcast([host], opts).wait()
            return
        buffer = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        group.broadcast([buffer], opts).wait()
        host.copy_(buffer)

    def _received(
        self,
        session: Session,
        info: UpdateInfo,
        buffers: list[torch.Tensor],
        nbytes: int | None,
        error: BaseException | None,
    ) -> dict[str, Any]:
        """On the loop: the chunk joins the session's staging, or the session ends."""
        self._busy = None
        if error is None and nbytes is not None:
            session.staged.update(zip(info.names, buffers, strict=True))
            session.received_bytes += nbytes
            return {"received_tensors": len(info.names), "received_bytes": session.received_bytes}
        self._spare.update(zip(info.names, buffers, strict=True))
        self._end(session)
        if isinstance(error, InvalidRequestError):
            raise error
        if isinstance(error, ValueError):
            raise InvalidRequestError("update_info", str(error)) from None
        if self.backend == "nccl":
            self._group, self.backend = None, None  # a broken collective cannot be trusted
        raise WeightTransferError(
            f"the weight transfer broke: {type(error).__name__}: {error}; the previous weights "
            "keep serving (init the transfer again before the next update)"
        )

    # -- finish ------------------------------------------------------------------------

    def finish_weight_update(
        self, weight_version: str | None = None, session: str | None = None
    ) -> Any:
        """Apply the session's update in place, all or nothing (the ACK); it ends the
        session either way. Refused — the old weights and version keep serving — when it
        carried nothing or not every tensor ``start`` announced."""
        self._check_idle()
        current = self._owned(session)
        version = "" if weight_version is None else check_weight_version(weight_version)
        self._session = None
        staged, current.staged = current.staged, {}
        try:
            if not staged:
                raise InvalidRequestError("update_info", "the update carried no tensors")
            missing = [n for n in current.announced or {} if n not in staged]
            if missing:
                raise InvalidRequestError(
                    "update_info.names",
                    f"{len(missing)} of the {len(current.announced or {})} tensors announced at "
                    f"start never arrived (first: {missing[:MISSING_SHOWN]}); nothing was "
                    "applied, the previous weights keep serving",
                )
            ack = self._apply(staged, version)
        except BaseException:
            self._spare.update(staged)
            raise
        # The applied tensors are now a reload source. When they replaced the whole history,
        # the previous ones are nobody's source any more: they stage the next update.
        sources = getattr(getattr(ack, "metadata", None), "weight_sources", None)
        if sources is not None and len(sources) == 1:
            self._spare.update(self._live)
            self._live = {}
        self._live.update(staged)
        return ack

    def abort_weight_update(self, session: str | None = None) -> dict[str, Any]:
        """End the caller's own session without applying it (the previous weights keep
        serving): a trainer that gives up lets the next ``start`` through."""
        self._check_idle()
        self._end(self._owned(session))
        return {"aborted": True}

    def weights_checksum(self) -> str:
        return weights_checksum(self._targets().items())
