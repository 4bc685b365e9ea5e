"""The decoded media held across requests are bounded: a decode that would pass the budget
waits until other decoded arrays die, is refused (429) when none do in time, and a medium
larger than the whole budget is a 400; every decoder counts its array before allocating it."""

from __future__ import annotations

import gc
import io
import threading
import time

import numpy as np
import pytest

from omnistage.entrypoints.media.budget import DecodedBudget
from omnistage.entrypoints.media.decode import decode_audio
from omnistage.entrypoints.media.policy import MediaPolicy
from omnistage.errors import CapacityError, InvalidRequestError


def held(budget: DecodedBudget, nbytes: int) -> np.ndarray:
    budget.take(nbytes, "where")
    array = np.empty(nbytes, np.uint8)
    budget.attach(array, nbytes)
    return array


def test_bytes_come_back_when_the_array_dies():
    budget = DecodedBudget(limit=10_000)
    array = held(budget, 6000)
    view = array[:10]  # a view keeps the memory alive
    del array
    gc.collect()
    assert budget.used == 6000
    del view
    gc.collect()
    assert budget.used == 0


def test_a_decode_past_the_budget_waits_for_another_array_to_die():
    budget = DecodedBudget(limit=10_000)
    first = held(budget, 8000)
    got: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: got.append(held(budget, 4000)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # 8000 + 4000 > 10000: it waits
    del first
    gc.collect()
    waiter.join(2)
    assert got and budget.used == 4000


def test_no_room_in_time_is_a_429_and_a_medium_larger_than_the_budget_a_400():
    budget = DecodedBudget(limit=10_000, wait_s=0.1)
    kept = held(budget, 8000)
    with pytest.raises(CapacityError, match="--max-media-decoded-bytes-in-flight"):
        budget.take(4000, "messages.0.content.0.input_audio.data")
    assert budget.used == 8000  # the refused decode took nothing
    with pytest.raises(InvalidRequestError) as info:
        budget.take(20_000, "messages.0.content.0.input_audio.data")
    assert info.value.field == "messages.0.content.0.input_audio.data"
    del kept


def test_an_audio_decode_counts_its_samples_until_they_are_dropped():
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, np.zeros(48_000, np.float32), 48_000, format="FLAC")
    budget = DecodedBudget(limit=1 << 20)
    audio = decode_audio(out.getvalue(), "where", MediaPolicy(budget=budget))
    assert budget.used == 48_000 * 4
    del audio
    gc.collect()
    assert budget.used == 0
    small = DecodedBudget(limit=1000)
    with pytest.raises(InvalidRequestError, match="more than the 1000"):
        decode_audio(out.getvalue(), "where", MediaPolicy(budget=small))
