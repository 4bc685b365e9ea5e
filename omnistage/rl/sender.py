"""``WeightSender``: the trainer's half of a weight sync with an omnistage stage.

Plain torch and httpx — no server code — so a training process imports it cheaply::

    sender = WeightSender("http://localhost:8000", stage_id=0, backend="nccl")
    sender.init()                                   # once: join the stage's group
    ack = sender.send(model.state_dict().items(), weight_version=step)
    assert sender.remote_checksum() == weights_checksum(model.state_dict().items())

Backends: ``nccl`` — a process group with the stage (NCCL on CUDA, gloo on CPU) where the
trainer is rank 0 and broadcasts each tensor (every broadcast of a chunk in flight at once);
``ipc`` — same host, nothing crosses a socket: CPU tensors are written once, straight into
the stage's own shared-memory staging (``start`` says where), the stage checking one chunk
while the next is written; a stage that offers no shared staging gets them in segments of
this process it copies out of; GPU tensors are shared as CUDA IPC handles. Every update announces its tensors first
(``start``), so a name, shape or dtype the stage does not have fails before anything moves,
and the stage applies nothing unless every announced tensor arrived.

Each ``send`` is a session the stage holds for this sender alone (``require_session``): a
second trainer's ``start`` is refused (409) while it is open, and nobody else's ``update`` or
``finish`` can touch it. A ``send`` that fails on this side after ``start`` aborts its own
session (best effort) so the next one can start. ``send(..., abort_open=True)`` discards a
session someone else left open (a trainer that died between ``start`` and ``finish``).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import mmap
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from multiprocessing import shared_memory
from typing import Any

import httpx
import torch

from omnistage.rl.bounds import check_timeout, check_weight_version
from omnistage.rl.protocol import BACKENDS, UpdateInfo, dtype_name, memcopy_many, weights_checksum

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
STAGED_CHUNK_BYTES = (
    64 * 1024 * 1024
)  # ipc into the stage's staging: checked while the next is written
MAPPED_SEGMENTS = 4  # the stage's staging segments kept mapped here
HTTP_MARGIN_S = 30.0  # an update answers at most the transfer's timeout after it was asked


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WeightSyncError(RuntimeError):
    """The stage refused or failed an update (its reply is the message)."""


class WeightSender:
    def __init__(
        self,
        base_url: str,
        *,
        stage_id: int = 0,
        backend: str = "nccl",
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 120.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        check_timeout(timeout_s, "timeout_s")  # the stage refuses more than it would wait
        self.base_url = base_url.rstrip("/")
        self.stage_id = stage_id
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port or _free_port()
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s + HTTP_MARGIN_S
        )
        self._session: str | None = None  # the stage's id of the update in progress
        self.replicas = 1  # the stage's processes, learnt at init
        self._group: Any = None
        self._store: Any = None
        self._segment: shared_memory.SharedMemory | None = None  # ipc: reused, faulted in once
        self._mapped: dict[str, StagingSegment] = {}  # the stage's staging, mapped

    # -- HTTP ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self._http.post(path, json={"stage_id": self.stage_id, **body})
        if reply.status_code != 200:
            raise WeightSyncError(f"POST {path}: {reply.status_code} {reply.text}")
        data: dict[str, Any] = reply.json()
        return data

    def remote_checksum(self) -> str:
        reply = self._http.get("/v1/omni/weights/checksum", params={"stage_id": self.stage_id})
        if reply.status_code != 200:
            raise WeightSyncError(f"checksum: {reply.status_code} {reply.text}")
        return str(reply.json()["checksum"])

    # -- the protocol ----------------------------------------------------------------------

    def _stage_replicas(self) -> int:
        """How many processes run the stage (its replicas; each joins the group)."""
        reply = self._http.get("/v1/omni/stages")
        if reply.status_code != 200:
            raise WeightSyncError(f"GET /v1/omni/stages: {reply.status_code} {reply.text}")
        stages = reply.json()["stages"]
        stage: dict[str, Any] = next((s for s in stages if s.get("stage_id") == self.stage_id), {})
        return len(stage.get("replicas") or [None])

    def init(self, *, abort_open: bool = False) -> None:
        """Join the stage (``nccl``: rank 0 of a group with each of the stage's replicas, on
        CPU through gloo); ``abort_open`` discards an update session left open on the stage."""
        body: dict[str, Any] = {"backend": self.backend, "init_info": {}, "abort_open": abort_open}
        self.replicas = self._stage_replicas()
        if self.backend == "ipc":
            self._post("/v1/omni/weights/init", body)
            return
        import torch.distributed as dist

        size = 1 + self.replicas
        body["init_info"] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": size,
            "timeout_s": self.timeout_s,
        }
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore(
            self.master_address, self.master_port, size, is_master=True, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        reply = self._in_background(lambda: self._post("/v1/omni/weights/init", body))
        if torch.cuda.is_available():
            nccl = dist.ProcessGroupNCCL
            self._group = nccl(self._store, 0, size, nccl.Options())
        else:
            self._group = dist.ProcessGroupGloo(self._store, 0, size, timeout)
        reply.result()

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | int | None = None,
        *,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        """Push ``named_tensors`` (state-dict names) and apply them as ``weight_version``;
        returns the stage's ACK. On any failure the stage keeps its previous weights (and
        version). ``abort_open``: discard an update session another sender left open
        instead of failing with its 409."""
        if weight_version is not None:
            check_weight_version(weight_version)  # before anything moves
        tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
        info = _describe(tensors)
        # Written straight into the stage's staging when it has one (a stage of one process).
        info.shared_staging = (
            self.backend == "ipc" and self.replicas == 1 and not any(t.is_cuda for _, t in tensors)
        )
        start = {"update_info": info.to_json(), "require_session": True, "abort_open": abort_open}
        started = self._post("/v1/omni/weights/start", start)
        self._session = str(started["session"])
        try:
            if "staging" in started:
                self._send_staged(tensors, started["staging"])
            for chunk in [] if "staging" in started else self._chunks(tensors):
                if self.backend == "ipc":
                    self._send_shared(chunk)
                else:
                    self._send_broadcast(chunk)
            finish = {"weight_version": weight_version, "session": self._session}
            ack = self._post("/v1/omni/weights/finish", finish)
        except BaseException:
            self._abort_own()
            raise
        self._session = None
        if ack["status"] != "SUCCESS":
            raise WeightSyncError(f"finish: {ack}")
        return dict(ack["acks"][0])

    def _update(self, info: UpdateInfo) -> dict[str, Any]:
        """One chunk's update call, in this sender's session."""
        return self._post(
            "/v1/omni/weights/update", {"update_info": info.to_json(), "session": self._session}
        )

    def _abort_own(self) -> None:
        """Best effort: end this sender's session if the stage still holds it open (a
        failed update or finish has ended it there already)."""
        session, self._session = self._session, None
        if session is None:
            return
        # The stage gone or busy receiving: the session ends with it, or by abort_open.
        with contextlib.suppress(httpx.HTTPError):
            self._http.post(
                "/v1/omni/weights/abort", json={"stage_id": self.stage_id, "session": session}
            )

    def _chunks(
        self, tensors: list[tuple[str, torch.Tensor]], limit: int | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        chunk: list[tuple[str, torch.Tensor]] = []
        size, limit = 0, limit or self.chunk_bytes
        for name, tensor in tensors:
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _send_staged(
        self, tensors: list[tuple[str, torch.Tensor]], places: list[dict[str, Any]]
    ) -> None:
        """Write each tensor once into the stage's staging where ``start`` said; each
        chunk's ``update`` (the stage checks it) runs while the next chunk is written."""
        where = dict(zip((name for name, _ in tensors), places, strict=True))
        self._map_only({str(place["shm"]) for place in places})
        pending = _Pending.done()
        try:
            for chunk in self._chunks(tensors, min(self.chunk_bytes, STAGED_CHUNK_BYTES)):
                writes = [
                    (self._mapped[str(where[name]["shm"])], int(where[name]["offset"]), tensor)
                    for name, tensor in chunk
                ]
                _write_all(writes)
                pending.result()  # one receive at a time on the stage
                info = _describe(chunk)
                info.staged = True
                pending = self._in_background(lambda info=info: self._update(info))
            pending.result()
        finally:
            pending.wait()  # failed here: the abort that follows must find the stage idle

    def _map_only(self, names: set[str]) -> None:
        """Map the stage's staging segments ``names`` (kept for the next updates; those of
        updates before are dropped beyond ``MAPPED_SEGMENTS``)."""
        for name in names - set(self._mapped):
            self._mapped[name] = StagingSegment(name)
        for name in [n for n in self._mapped if n not in names][: -MAPPED_SEGMENTS or None]:
            self._mapped.pop(name).close()

    def _send_broadcast(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        if self._group is None:
            raise WeightSyncError("call init() first")
        reply = self._in_background(lambda: self._update(_describe(chunk)))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        works = [self._group.broadcast([tensor.to(device)], opts) for _, tensor in chunk]
        for work in works:  # all in flight: no round trip per tensor
            work.wait()
        reply.result()

    def _send_shared(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        info = _describe(chunk)
        if chunk and chunk[0][1].is_cuda:  # never run on a GPU yet
            info.ipc_handles = [_cuda_handle(t) for _, t in chunk]
            self._update(info)
            return
        segment = self._shared(sum(t.numel() * t.element_size() for _, t in chunk))
        if segment.buf is None:
            raise WeightSyncError("the shared segment is closed")
        handles, offset = [], 0
        for _, tensor in chunk:
            nbytes = tensor.numel() * tensor.element_size()
            _write(segment, offset, tensor)
            handles.append({"shm": segment.name, "offset": offset})
            offset += nbytes
        info.ipc_handles = handles
        # The stage has copied the chunk out when it replies: the segment is free again.
        self._update(info)

    def _shared(self, nbytes: int) -> shared_memory.SharedMemory:
        """The shared segment, grown to ``nbytes`` if needed (kept for the next chunks)."""
        if self._segment is None or self._segment.size < nbytes:
            self._release_segment()
            self._segment = shared_memory.SharedMemory(create=True, size=max(1, nbytes))
        return self._segment

    def _release_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None

    @staticmethod
    def _in_background(call: Any) -> _Pending:
        pending = _Pending()
        threading.Thread(target=pending.run, args=(call,), daemon=True).start()
        return pending

    def close(self) -> None:
        self._release_segment()
        for segment in self._mapped.values():
            segment.close()
        self._mapped.clear()
        self._group = None
        self._store = None
        self._http.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pending:
    """An HTTP call running beside a collective (both sides must be in it at once)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self, call: Any) -> None:
        try:
            self._value = call()
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            self._done.set()

    @classmethod
    def done(cls) -> _Pending:
        pending = cls()
        pending._done.set()
        return pending

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class StagingSegment:
    """A stage's staging segment, mapped in this process: never registered with this
    process's resource tracker (which could share the stage's) nor removed here."""

    def __init__(self, name: str) -> None:
        if not name or "/" in name:
            raise WeightSyncError(f"the stage named no staging segment: {name!r:.80}")
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        try:
            self.buf: mmap.mmap | None = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.size = len(self.buf)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None


def _write(segment: Any, offset: int, tensor: torch.Tensor) -> None:
    _write_all([(segment, offset, tensor)])


def _write_all(writes: list[tuple[Any, int, torch.Tensor]]) -> None:
    """Each ``tensor``'s bytes into its ``segment`` at ``offset`` (host tensors by glibc's
    ``memmove`` without the GIL, on two threads: ``memcopy_many``)."""
    copies = []
    for segment, offset, tensor in writes:
        nbytes = tensor.numel() * tensor.element_size()
        if segment.buf is None or offset < 0 or offset + nbytes > segment.size:
            raise WeightSyncError("the stage's staging place does not fit the tensor")
        if not nbytes:
            continue
        view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        if tensor.device.type == "cpu":
            copies.append((view.data_ptr(), tensor.data_ptr(), nbytes))
        else:
            view.view(tensor.dtype).copy_(tensor.reshape(-1))
        del view  # the segment's address stays valid: it is mapped until closed
    memcopy_many(copies)


def _describe(tensors: list[tuple[str, torch.Tensor]]) -> UpdateInfo:
    return UpdateInfo(
        names=[name for name, _ in tensors],
        dtype_names=[dtype_name(t.dtype) for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors],
    )


def _cuda_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC handle of ``tensor``'s storage, in plain JSON (never run on a GPU yet)."""
    storage = tensor.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()  # type: ignore[attr-defined]
    return {
        "cuda": {
            "device": int(device),
            "handle": base64.b64encode(handle).decode(),
            "storage_size": int(size),
            "storage_offset": int(offset),
            "ref_counter_handle": base64.b64encode(ref_handle).decode(),
            "ref_counter_offset": int(ref_offset),
            "event_handle": base64.b64encode(event).decode() if event else "",
            "event_sync_required": bool(sync),
            "tensor_offset": int(tensor.storage_offset()),
        }
    }


__all__ = ["WeightSender", "WeightSyncError", "weights_checksum"]
