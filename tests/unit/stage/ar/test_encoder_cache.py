"""The encoder cache: the same medium is encoded once, by content; another medium, or the same
one processed another way, is encoded again; bounded in bytes, least recently used out."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.stage.ar.multi_modal import EncoderCache
from omnistage.stage.ar.wire import MultiModalItem


class CountingEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return pixels * 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoders = nn.ModuleDict({"image": CountingEncoder()})


def image(content_hash: str, rows: int = 4, value: float = 1.0) -> MultiModalItem:
    pixels = torch.full((rows, 8), value)
    return MultiModalItem("image", 0, rows, {"pixels": pixels}, content_hash)


def test_the_same_content_is_encoded_once():
    model, cache = Model(), EncoderCache(1 << 20)
    first = cache.encode(model, image("a"))
    again = cache.encode(model, image("a"))
    assert torch.equal(first, again)
    assert model.encoders["image"].calls == 1
    assert cache.status() == {"queries": 2, "hits": 1, "entries": 1, "bytes": 4 * 8 * 4}


def test_other_content_or_other_processing_is_encoded_again():
    model, cache = Model(), EncoderCache(1 << 20)
    cache.encode(model, image("a"))
    cache.encode(model, image("b", value=3.0))
    cache.encode(model, image("a", rows=6))  # the same medium, processed to another shape
    assert model.encoders["image"].calls == 3
    assert cache.hits == 0


def test_items_without_a_hash_and_a_zero_budget_are_never_cached():
    model = Model()
    cache = EncoderCache(1 << 20)
    cache.encode(model, image(""))
    cache.encode(model, image(""))
    off = EncoderCache(0)
    off.encode(model, image("a"))
    off.encode(model, image("a"))
    assert model.encoders["image"].calls == 4
    assert cache.status()["entries"] == off.status()["entries"] == 0


def test_bounded_in_bytes_least_recently_used_out():
    model, cache = Model(), EncoderCache(2 * 4 * 8 * 4)  # room for two items
    cache.encode(model, image("a"))
    cache.encode(model, image("b"))
    cache.encode(model, image("a"))  # a is now the most recent
    cache.encode(model, image("c"))  # b goes
    assert cache.status()["entries"] == 2 and cache.nbytes == 2 * 4 * 8 * 4
    calls = model.encoders["image"].calls
    cache.encode(model, image("a"))
    assert model.encoders["image"].calls == calls
    cache.encode(model, image("b"))
    assert model.encoders["image"].calls == calls + 1


def test_clear_forgets_everything():
    model, cache = Model(), EncoderCache(1 << 20)
    cache.encode(model, image("a"))
    cache.clear()
    cache.encode(model, image("a"))
    assert model.encoders["image"].calls == 2
    assert cache.nbytes == 4 * 8 * 4
