"""Streamed input of an AR stage: a request whose prompt and decode embeddings come while the
stage before still runs (``AppendInput`` messages, through its processor's stream). Its
request waits for its prompt; once running, a step whose decode embedding has not come yet
waits (``SequenceState.is_ready``) while the others go on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from omnistage.errors import StageAsleepError, StageInternalError
from omnistage.stage.types import StageOutput


class StreamedInput:
    """``ARStageEngine``'s part for streamed requests (it holds ``_awaiting``)."""

    STREAM_INPUT = "embeds"  # its streams give prompt fields and decode embeddings

    _awaiting: dict[str, Any]
    _deferred: dict[str, list[tuple[dict[str, Any] | None, bool]]]
    _queued_outputs: list[StageOutput]
    if TYPE_CHECKING:  # the engine's
        stage_id: int
        sleep_control: Any
        requests: Any
        device: torch.device
        worker: Any

        def add_wire_request(self, request_id: str, request: object) -> None: ...
        def _fail(self, seq: Any, error: Exception) -> None: ...

    def add_streamed_request(self, request_id: str, request: object) -> None:
        """Hold ``request`` (its parameters) until its prompt comes (``append_input``)."""
        if self.sleep_control.is_sleeping:
            raise StageAsleepError(self.stage_id)
        self._awaiting[request_id] = request

    def append_input(self, request_id: str, fields: dict[str, Any] | None, ended: bool) -> None:
        """More of a streamed request's input: its prompt fields first (it is queued then),
        then decode embeddings as they come; ``ended``: nothing more comes (its last row
        repeats). Input for a request no longer here is dropped.

        While the stage sleeps (a ``keep`` sleep, or a ``wait`` sleep's request whose prompt
        had not come), input for a request it holds is kept aside and applied once it wakes
        (``replay_deferred``): the request was admitted before the sleep, so it is neither
        refused nor lost, and nothing reaches the device while its memory is released."""
        known = request_id in self._awaiting or bool(self.requests.samples(request_id))
        if self.sleep_control.is_sleeping and known:
            self._deferred.setdefault(request_id, []).append((fields, ended))
            return
        template = self._awaiting.get(request_id)
        if template is not None:
            if not fields or "prompt_token_ids" not in fields:
                if ended:  # ended before it could start
                    del self._awaiting[request_id]
                    raise StageInternalError("the streamed input ended before its prompt")
                return
            del self._awaiting[request_id]
            self.add_wire_request(request_id, msgspec.structs.replace(template, **fields))
            for seq in self.requests.samples(request_id):
                seq.input_open = not ended
            return
        for seq in self.requests.samples(request_id):
            rows = (fields or {}).get("decode_embeds")
            if rows is not None:
                rows = rows.to(self.device, self.worker.runner.dtype)
                old = seq.decode_embeds
                seq.decode_embeds = rows if old is None else torch.cat([old, rows])
            seq.input_open = seq.input_open and not ended

    def replay_deferred(self) -> None:
        """Apply the input kept aside while the stage slept, in the order it came; a request
        whose input fails now fails as it would have then."""
        deferred, self._deferred = self._deferred, {}
        for request_id, inputs in deferred.items():
            try:
                for fields, ended in inputs:
                    self.append_input(request_id, fields, ended)
            except Exception as exc:
                self.fail_request(request_id, exc)

    def fail_request(self, request_id: str, exc: Exception) -> None:
        """End a streamed request with ``exc`` (its input was refused)."""
        self._deferred.pop(request_id, None)
        if self._awaiting.pop(request_id, None) is not None:
            self._queued_outputs.append(
                StageOutput(request_id, finished=True, finish_reason="error", error=exc)
            )
        for seq in self.requests.samples(request_id):
            self._fail(seq, exc)

    def _drop_awaiting(self, request_id: str, reason: str = "abort") -> None:
        self._deferred.pop(request_id, None)
        if self._awaiting.pop(request_id, None) is not None:
            self._queued_outputs.append(
                StageOutput(request_id, finished=True, finish_reason=reason)  # type: ignore[arg-type]
            )
