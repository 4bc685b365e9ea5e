"""What one stage hands the next for a request goes stage to stage, never through the API
process: the producing stage leaves it with a transport and sends the API process only a
``HandoffRef``; the API process passes the reference on with the next stage's request, and
that stage takes the payload and runs the pipeline's processor on it (off the API process's
event loop). The API process only ever sees what the client gets.

Transports (the launcher picks one, ``StartupOptions.handoff``):

- ``shm`` (stages on one host): the payload is written to a POSIX shared-memory segment
  (``/dev/shm/omnistage-handoff-<pid>-<n>``); the taker reads and unlinks it, a discard
  unlinks it.
- ``socket`` (stages across hosts, Ray): the producer keeps the payload and serves it once
  over a ZMQ socket bound on its node's address; the taker fetches it.

A payload nobody will take (the request ended between the stages) is discarded by its
producer when the API process says so (``DiscardHandoff``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections import OrderedDict
from typing import Any, Protocol

import msgspec
import zmq

from omnistage.errors import StageInternalError
from omnistage.stage.messages import Handoff, HandoffRef, Upstream, decoder, encode
from omnistage.stage.types import StageOutput

logger = logging.getLogger(__name__)

SHM, SOCKET = "shm", "socket"
TRANSPORTS = (SHM, SOCKET)
FETCH_TIMEOUT_S = 30.0
MAX_REMEMBERED = 4096  # payloads a stage remembers leaving (for aborts)


_decode_handoff = decoder(Handoff)
_counter = itertools.count(1)


class Transport(Protocol):
    def put(self, payload: Handoff) -> HandoffRef: ...
    def discard(self, ref: HandoffRef) -> None: ...
    def close(self) -> None: ...


# -- shared memory (one host) ----------------------------------------------------------------


def _shm() -> Any:
    import _posixshmem  # type: ignore[import-not-found]

    return _posixshmem


class SharedMemoryTransport:
    def put(self, payload: Handoff) -> HandoffRef:
        data = encode(payload)
        name = f"omnistage-handoff-{os.getpid()}-{next(_counter)}"
        fd = _shm().shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, max(len(data), 1))
            with mmap.mmap(fd, max(len(data), 1)) as mapped:
                mapped[: len(data)] = data
        finally:
            os.close(fd)
        return HandoffRef(SHM, name, nbytes=len(data))

    def discard(self, ref: HandoffRef) -> None:
        _unlink(ref.key)

    def close(self) -> None:
        pass


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # taken, or discarded already
        _shm().shm_unlink("/" + name)


def _take_shm(ref: HandoffRef) -> bytes:
    try:
        fd = _shm().shm_open("/" + ref.key, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        raise StageInternalError(
            f"the upstream stage's output for this request is gone ({ref.key})"
        ) from None
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            data = mapped[: ref.nbytes]
    finally:
        os.close(fd)
        _unlink(ref.key)
    return data


# -- a socket (across hosts) -----------------------------------------------------------------


class SocketTransport:
    """Payloads kept here and served once each over a ROUTER socket bound on ``host``."""

    def __init__(self, host: str) -> None:
        self._payloads: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        port = self._server.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="handoff-server", daemon=True)
        self._thread.start()

    def put(self, payload: Handoff) -> HandoffRef:
        data = encode(payload)
        key = f"{os.getpid()}-{next(_counter)}"
        with self._lock:
            self._payloads[key] = data
        return HandoffRef(SOCKET, key, self.address, len(data))

    def discard(self, ref: HandoffRef) -> None:
        with self._lock:
            self._payloads.pop(ref.key, None)

    def _serve(self) -> None:
        while not self._closing.is_set():
            if not self._server.poll(100):
                continue
            peer, key = self._server.recv_multipart()
            with self._lock:
                data = self._payloads.pop(key.decode(), b"")
            self._server.send_multipart([peer, data])

    def close(self) -> None:
        self._closing.set()
        self._thread.join(1.0)
        self._server.close(linger=0)
        self._ctx.term()


def _take_socket(ref: HandoffRef) -> bytes:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(ref.address)
        sock.send(ref.key.encode())
        if not sock.poll(int(FETCH_TIMEOUT_S * 1000)):
            raise StageInternalError(
                f"the upstream stage at {ref.address} did not hand over its output within "
                f"{FETCH_TIMEOUT_S:g}s"
            )
        data: bytes = sock.recv()
    finally:
        sock.close()
    if not data:
        raise StageInternalError(
            f"the upstream stage's output for this request is gone ({ref.key})"
        )
    return data


def make_transport(name: str, host: str = "127.0.0.1") -> Transport:
    if name == SOCKET:
        return SocketTransport(host)
    if name == SHM:
        return SharedMemoryTransport()
    raise ValueError(f"unknown hand-off transport {name!r}; known: {list(TRANSPORTS)}")


def take(ref: HandoffRef) -> Handoff:
    """The payload ``ref`` names (it is gone from its transport afterwards)."""
    data = _take_shm(ref) if ref.transport == SHM else _take_socket(ref)
    return _decode_handoff.decode(data)


class Handoffs:
    """One stage's side of the hand-offs: the requests it forwards (their text and token ids
    gathered as they stream, their payload left with ``transport`` when they finish) and the
    requests it takes from the stage before (``resolve``)."""

    def __init__(self, transport: Transport, folder: str) -> None:
        self.transport = transport
        self.folder = folder  # the stage's checkpoint, which processors read
        self._forwarded: dict[str, tuple[list[str], list[int]]] = {}
        # The last payloads left, by request: an abort of one (its end never reached the API
        # process) discards its payload.
        self._left: OrderedDict[str, HandoffRef] = OrderedDict()

    def forward(self, request_id: str) -> None:
        self._forwarded[request_id] = ([], [])

    def observe(self, out: StageOutput) -> HandoffRef | None:
        """Gather a forwarded request's output; on its successful end, leave its payload with
        the transport and return where."""
        gathered = self._forwarded.get(out.request_id)
        if gathered is None:
            return None
        gathered[0].append(out.text_delta)
        gathered[1].extend(out.new_token_ids)
        if not out.finished:
            return None
        del self._forwarded[out.request_id]
        if out.finish_reason not in ("stop", "length"):
            return None
        extra = out.handoff or {}
        payload = Handoff(
            text="".join(gathered[0]),
            # what the next stage takes before the generated ids (a cloned voice's reference)
            token_ids=list(extra.get("context_token_ids", [])) + gathered[1],
            hidden_states=extra.get("hidden_states"),
            token_embeddings=extra.get("token_embeddings"),
            num_prompt_tokens=out.num_prompt_tokens,
            positions=extra.get("positions"),
            position_delta=int(extra.get("position_delta", 0)),
            prompt_token_ids=list(extra.get("prompt_token_ids", [])),
        )
        ref = self.transport.put(payload)
        self._left[out.request_id] = ref
        while len(self._left) > MAX_REMEMBERED:
            self._left.popitem(last=False)
        return ref

    def aborted(self, request_id: str) -> None:
        """The request was aborted: what it left for the next stage will not be taken."""
        self._forwarded.pop(request_id, None)
        ref = self._left.pop(request_id, None)
        if ref is not None:
            self.transport.discard(ref)

    def resolve(self, request: Any, upstream: Upstream) -> Any:
        """``request`` with its prompt filled from what the stage before handed over, by the
        pipeline's processor (``InvalidRequestError`` and the like fail the request)."""
        from omnistage.models import registry

        payload = as_upstream_result(take(upstream.ref), params=upstream.params)
        fields = registry.processor(upstream.processor).convert(payload, self.folder)
        try:
            return msgspec.structs.replace(request, **fields)
        except TypeError as exc:
            raise StageInternalError(
                f"processor {upstream.processor!r} made fields this stage does not take: {exc}"
            ) from None

    def discard(self, ref: HandoffRef) -> None:
        self._left = OrderedDict((k, v) for k, v in self._left.items() if v != ref)
        self.transport.discard(ref)

    def close(self) -> None:
        self.transport.close()


def as_upstream_result(handoff: Handoff, **fields: Any) -> Any:
    """A hand-off as the next stage's processor takes it (a ``UpstreamResult``), ``fields``
    over its own; its lists are copies."""
    from omnistage.models.processors import UpstreamResult

    own = msgspec.structs.asdict(handoff)
    own.update(token_ids=list(handoff.token_ids), prompt_token_ids=list(handoff.prompt_token_ids))
    return UpstreamResult(**{**own, **fields})
