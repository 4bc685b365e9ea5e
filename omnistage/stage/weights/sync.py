"""Weights pushed by a trainer without disk — vLLM's weight-transfer protocol, for one worker.

``init_weight_transfer(backend, init_info)`` once (``nccl``: a process group with the trainer,
NCCL on CUDA, gloo on CPU; ``ipc``: shared-memory segments or CUDA IPC handles, same host), then
per update ``start_weight_update`` → ``receive_weights`` (chunks) → ``finish_weight_update``.
An update is a session with an owner; tensors are staged in host memory and checked as they
arrive, and only ``finish`` copies them into the live weights, all or nothing; the blocking
parts run on the stage's ``Background`` thread while it serves on the old weights. The rules
(sessions and their 409s, the checks, shared staging, the reload source) are in
``docs/rl.md``, "Weight sync without disk".
"""

from __future__ import annotations

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
from omnistage.stage.weights.checks import Session, check_handles, check_tensors
from omnistage.stage.weights.rendezvous import RENDEZVOUS_ERRORS, join_trainer
from omnistage.stage.weights.staging import StagingPool, StagingSet, layout_of
from omnistage.stage.weights.transports import STAGED, Transport, transport_for

logger = logging.getLogger(__name__)

Targets = Callable[[], Mapping[str, torch.Tensor]]  # live weights by checkpoint name
Apply = Callable[[dict[str, torch.Tensor], str], Any]  # staged tensors, version -> ACK
MISSING_SHOWN = 8  # missing tensors a refused finish names


class WeightSync:
    def __init__(
        self,
        stage_id: int,
        targets: Targets,
        apply: Apply,
        device: torch.device,
        *,
        shared: bool | None = None,
    ) -> None:
        """``shared``: stage in shared memory (default: on a host stage)."""
        self.stage_id = stage_id
        self._targets = targets
        self._apply = apply
        self.device = device
        self.shared = device.type == "cpu" if shared is None else shared
        pinned = device.type == "cuda" and not self.shared
        self._pool = StagingPool(self.shared, pinned=pinned, required=shared is True)
        self.transport: Transport | None = None  # set by init_weight_transfer
        self._session: Session | None = None
        self._busy: str | None = None  # "init" or "receive" while its thread runs
        self._live: list[StagingSet] = []  # the sets of the updates a reload replays

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
        self.transport = None  # the old group is not trusted across an init
        if info is None:
            self.transport = transport_for(backend)
            return {"backend": backend, "rank": 1}
        self._busy = "init"
        return Background(
            f"stage {self.stage_id}: join trainer",
            lambda: self._join(info),
            lambda group, error: self._joined(info, group, error),
        ).start()

    def _join(self, info: InitInfo) -> Any:
        """On the transfer's thread: the rendezvous and the group, within timeout_s."""
        return join_trainer(info, self.device.type)

    def _joined(self, info: InitInfo, group: Any, error: BaseException | None) -> dict[str, Any]:
        self._busy = None
        if isinstance(error, TimeoutError) or type(error).__name__ in RENDEZVOUS_ERRORS:
            # The trainer is not there: the caller's problem (a 4xx), not the server's.
            raise InvalidRequestError(
                "init_info",
                f"no trainer joined the rendezvous at {info.master_address}:"
                f"{info.master_port} within timeout_s={info.timeout_s:g} s: start the "
                "trainer's rank 0 there first (or give a longer timeout_s)",
            )
        if error is not None:  # a group that did not form: a failed init, not a dead stage
            raise WeightTransferError(
                f"could not join the trainer at {info.master_address}:{info.master_port}: "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
        self.transport = transport_for("nccl", group)
        return {"backend": "nccl", "rank": info.rank_offset}

    # -- sessions ----------------------------------------------------------------------

    def start_weight_update(
        self,
        update_info: dict[str, Any] | None = None,
        require_session: bool = False,
        abort_open: bool = False,
    ) -> dict[str, Any] | Background[Any]:
        """Open an update session. ``update_info`` may announce every tensor the update will
        carry: they are checked now, before any byte moves, so a trainer learns of a bad
        name, shape or dtype before it starts broadcasting (a collective the stage would
        not join) — and ``finish`` then refuses an update that did not carry them all.
        An announced update gets its staging set now; a new one is made (its memory
        reserved and faulted in) on the transfer's thread, the stage serving meanwhile."""
        self._check_idle()
        if self.transport is None:
            raise InvalidRequestError(
                "backend", "call init_weight_transfer (init_weight_transfer_engine) first"
            )
        self._check_takeover(abort_open)
        announced, share = None, False
        if update_info is not None:
            info = UpdateInfo.from_json(update_info)
            announced = check_tensors(info, self._targets(), None, gloo=self._gloo)
            share = info.shared_staging and self.transport.shares_staging and self.shared
        self._abort_open()
        session = Session(secrets.token_hex(16), require_session, announced, shared=share)
        if announced is None:
            return self._started(session, None, None)
        layout = layout_of(announced)  # one staging set for the whole update
        spare = self._pool.spare(layout)
        if spare is not None:
            return self._started(session, spare, None)
        self._busy = "start"
        return Background(
            f"stage {self.stage_id}: stage a weight update",
            lambda: self._pool.new(layout),
            lambda staging, error: self._started(session, staging, error),
        ).start()

    def _started(
        self, session: Session, staging: StagingSet | None, error: BaseException | None
    ) -> dict[str, Any]:
        """The session open (with ``staging`` for its announced tensors, if any)."""
        self._busy = None
        if error is not None:
            raise error
        reply: dict[str, Any] = {"started": True, "session": session.id}
        if staging is not None:
            session.sets.append(staging)
            session.buffers = dict(staging.tensors)
            session.shared = session.shared and staging.name is not None  # else: handles
            if session.shared:
                reply["staging"] = staging.locations(list(session.announced or {}))
        self._session = session
        return reply

    @property
    def backend(self) -> str | None:
        """The transport's name (``nccl``, ``ipc``); None before ``init_weight_transfer``."""
        return None if self.transport is None else self.transport.name

    @property
    def _gloo(self) -> bool:
        return self.transport is not None and self.transport.uses_gloo(self.device)

    def _check_idle(self) -> None:
        """One transfer call at a time (its thread owns the group and the staging)."""
        if self._busy == "init":
            raise ConflictError(
                "backend", "the transfer is still joining the trainer; retry once init answers"
            )
        if self._busy == "start":
            raise ConflictError(
                "session", "a weight update is still being set up; retry once start answers"
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
        """Close ``session``; its staging sets become spare again."""
        self._pool.keep(session.sets)
        session.sets, session.staged, session.buffers = [], {}, {}
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
            if info.staged and not current.shared:
                raise InvalidRequestError(
                    "update_info.staged",
                    "needs a session started with shared_staging (and its staging answer)",
                )
            if not info.staged:
                check_handles(info, self.backend, self.device)
        except InvalidRequestError:
            self._end(current)
            raise
        if not all(name in current.buffers for name in info.names):  # unannounced: a set
            staging = self._pool.take(layout_of(specs))
            current.sets.append(staging)
            current.buffers.update(staging.tensors)
        buffers = [current.buffers[name] for name in info.names]
        transport = STAGED if info.staged else self.transport
        if transport is None:  # a session outlives no init: never, but say so if it did
            self._end(current)
            raise InvalidRequestError(
                "backend", "call init_weight_transfer (init_weight_transfer_engine) first"
            )
        self._busy = "receive"
        return Background(
            f"stage {self.stage_id}: receive weights",
            lambda: self._transfer(info, buffers, transport),
            lambda received, error: self._received(current, info, buffers, received, error),
        ).start()

    def _transfer(self, info: UpdateInfo, buffers: list[torch.Tensor], transport: Transport) -> int:
        """On the transfer's thread: fill ``buffers`` (only they, and the transport, are
        used here) and check them; the bytes received."""
        torch.set_num_threads(1)  # this thread's checks; the stage's loop keeps its threads
        transport.receive(list(zip(info.names, buffers, strict=True)), info, self.device)
        return sum(t.numel() * t.element_size() for t in buffers)

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
        self._end(session)
        if isinstance(error, InvalidRequestError):
            raise error
        if isinstance(error, ValueError):
            raise InvalidRequestError("update_info", str(error)) from None
        if self.transport is not None and self.transport.lost_on_error:
            self.transport = None  # a broken collective cannot be trusted
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
        staged, sets = current.staged, current.sets
        current.staged, current.sets, current.buffers = {}, [], {}
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
            self._pool.keep(sets)
            raise
        # The applied tensors are now a reload source. When they replaced the whole history,
        # the previous ones are nobody's source any more: they stage the next update.
        sources = getattr(getattr(ack, "metadata", None), "weight_sources", None)
        if sources is not None and len(sources) == 1:
            self._pool.keep(self._live)
            self._live = []
        self._live.extend(sets)
        return ack

    def abort_weight_update(self, session: str | None = None) -> dict[str, Any]:
        """End the caller's own session without applying it (the previous weights keep
        serving): a trainer that gives up lets the next ``start`` through."""
        self._check_idle()
        self._end(self._owned(session))
        return {"aborted": True}

    def weights_checksum(self) -> str:
        targets = self._targets()
        if any(t.is_meta for t in targets.values()):
            raise InvalidRequestError(
                "stage_id", "the weights checksum of a tensor-parallel stage is not available"
            )
        return weights_checksum(targets.items())
