"""A control call whose blocking part runs on a thread of the stage process.

Receiving a weight chunk waits on the trainer (a broadcast, up to the transfer's timeout) and
joining a trainer waits for its rendezvous; on the stage loop either would freeze every
request the stage serves. A handler returns a ``Background`` instead of its value: the work
runs on a daemon thread, the loop (``StageCore``) keeps stepping, and once ``ready()`` it
calls ``answer()`` on its own thread — where ``settle`` updates the owner's state (nothing
but ``work`` ever runs beside the loop) and returns the call's reply or raises its error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# settle(value, error): exactly one of them is set; returns the reply or raises.
Settle = Callable[[Any, BaseException | None], Any]


class Background(Generic[T]):
    def __init__(self, name: str, work: Callable[[], T], settle: Settle) -> None:
        self.name = name
        self._work = work
        self._settle = settle
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._answered = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Background[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # handed to settle() on the loop's thread
            self._error = exc
        finally:
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the work is done (tests and callers without a loop)."""
        return self._done.wait(timeout_s)

    def answer(self) -> Any:
        """The call's reply, settled on the caller's thread (once; the work must be done)."""
        if not self._done.is_set():
            raise RuntimeError(f"{self.name}: answer() before the work finished")
        if self._answered:
            raise RuntimeError(f"{self.name}: answered twice")
        self._answered = True
        return self._settle(self._value, self._error)


def run_to_answer(result: Any) -> Any:
    """``result`` itself, or — for a ``Background`` — its answer once the work is done: what
    a caller without a stage loop (the Python API, tests) makes of a handler's return."""
    if isinstance(result, Background):
        result.wait()
        return result.answer()
    return result
