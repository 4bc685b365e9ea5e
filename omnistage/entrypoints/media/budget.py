"""The decoded media the API process holds across requests, bounded
(``--max-media-decoded-bytes-in-flight``).

A medium is small on the wire and large decoded (an 89 KB FLAC is 115 MB of samples), and a
request holds its decoded media from the moment they are decoded until its prompt is
prepared (features, patches), which waits its turn. A decode takes the bytes its header
announces from this budget before it allocates them (``take``, on the decoding thread): when
the other requests' decoded media leave no room, it waits for room (the decode threads with
it: backpressure), and is refused with a 429 naming the flag when none frees within
``wait_s``; a medium larger than the whole budget is a 400.

The bytes come back when the array holding them dies (``attach``: ``weakref.finalize``) —
once the request's prompt has been prepared and its decoded media dropped, or the request
failed — whichever thread drops it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from omnistage.errors import CapacityError, InvalidRequestError

FLAG = "--max-media-decoded-bytes-in-flight"


class DecodedBudget:
    """Bytes of decoded media held across requests, at most ``limit``."""

    def __init__(self, limit: int, wait_s: float = 30.0) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self._used = 0
        self._room = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int, where: str) -> None:
        """Count ``nbytes`` a decode is about to allocate, waiting (this thread) for room;
        ``where`` names the medium in a refusal. Pair with ``attach`` or ``give_back``."""
        if nbytes > self.limit:
            raise InvalidRequestError(
                where,
                f"it decodes to {nbytes} bytes, more than the {self.limit} the server holds "
                f"for all requests at once ({FLAG})",
            )
        with self._room:
            if not self._room.wait_for(lambda: self._used + nbytes <= self.limit, self.wait_s):
                raise CapacityError(
                    where,
                    f"the server holds {self._used} bytes of other requests' decoded media "
                    f"and {nbytes} more would pass {self.limit} ({FLAG}); retry shortly",
                )
            self._used += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._room:
            self._used -= nbytes
            self._room.notify_all()

    def attach(self, array: Any, nbytes: int) -> None:
        """``nbytes`` taken for ``array`` come back when it dies."""
        weakref.finalize(array, self.give_back, nbytes)
