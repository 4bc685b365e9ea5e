"""Multimodal items of an AR request: the way non-text inputs reach the decoder.

An item (``MultiModalItem``) names where its placeholder tokens sit in the prompt, its
processed input and a hash of the raw input. The model runner's encoder step turns each into
embeddings that replace its placeholders' (``encode_item``): items of modality ``embeds``
carry them already (computed elsewhere, as vLLM's ``image_embeds``); any other modality runs
the encoder the model family put in ``model.encoders[modality]``. Which modalities a stage
takes, it reports (``ARStageInfo.multi_modal``); requests are checked against that here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from omnistage.errors import InvalidRequestError
from omnistage.stage.ar.wire import MultiModalItem

EMBEDS = "embeds"  # embeddings computed elsewhere, taken as they are


def modalities(model: nn.Module) -> list[str]:
    """The modalities ``model`` takes: precomputed embeddings and its encoders'."""
    encoders = getattr(model, "encoders", None)
    return [EMBEDS, *(sorted(encoders) if encoders is not None else [])]


class EncoderCache:
    """Encoder outputs by the content of the media they came from: the same picture or sound
    sent again is not encoded again. Least recently used first out, bounded in bytes; emptied
    when the weights change and when the stage sleeps (its memory is released with the rest).
    An item without a content hash is never cached."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self.hits = 0
        self.queries = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    @staticmethod
    def key(item: MultiModalItem) -> str | None:
        if not item.content_hash or item.modality == EMBEDS:
            return None
        # The processed input's shapes too: one medium processed two ways (other pixel
        # bounds, audio in a video or not) gives other embeddings.
        shapes = ",".join(f"{k}{list(v.shape)}" for k, v in sorted(item.data.items()))
        return f"{item.modality}:{item.content_hash}:{item.length}:{shapes}"

    def encode(self, model: nn.Module, item: MultiModalItem) -> torch.Tensor:
        key = self.key(item) if self.capacity_bytes > 0 else None
        if key is None:
            return encode_item(model, item)
        self.queries += 1
        hit = self._entries.get(key)
        if hit is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return hit
        encoded = encode_item(model, item)
        size = encoded.numel() * encoded.element_size()
        if size <= self.capacity_bytes:
            self._entries[key] = encoded
            self.nbytes += size
            while self.nbytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
        return encoded

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def status(self) -> dict[str, int]:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "entries": len(self._entries),
            "bytes": self.nbytes,
        }


def encode_item(model: nn.Module, item: MultiModalItem) -> torch.Tensor:
    """``[item.length, embedding_size]``: the embeddings of the item's placeholders."""
    if item.modality == EMBEDS:
        return item.data[EMBEDS]
    encoders = getattr(model, "encoders", {})
    encoded: torch.Tensor = encoders[item.modality](**item.data)
    return encoded


def check_items(
    items: Sequence[MultiModalItem], prompt_len: int, embed_dim: int, allowed: Sequence[str]
) -> None:
    """``InvalidRequestError`` naming what is wrong with a request's items: a modality the
    stage has no encoder for, a placeholder range outside the prompt or overlapping another,
    embeddings of the wrong shape or not finite."""
    end = 0
    for i, item in enumerate(items):
        field = f"multi_modal.{i}"
        if item.modality not in allowed:
            raise InvalidRequestError(
                f"{field}.modality",
                f"this stage takes no {item.modality!r} input; it takes {list(allowed)}",
            )
        if item.offset < end or item.offset + item.length > prompt_len:
            raise InvalidRequestError(
                field,
                f"placeholders [{item.offset}, {item.offset + item.length}) must lie in the "
                f"prompt ({prompt_len} tokens), in order and without overlapping",
            )
        end = item.offset + item.length
        if item.modality == EMBEDS:
            embeds = item.data.get(EMBEDS)
            if not isinstance(embeds, torch.Tensor) or list(embeds.shape) != [
                item.length,
                embed_dim,
            ]:
                raise InvalidRequestError(
                    f"{field}.data.{EMBEDS}", f"must be a tensor [{item.length}, {embed_dim}]"
                )
            if not embeds.is_floating_point() or not bool(torch.isfinite(embeds).all()):
                raise InvalidRequestError(f"{field}.data.{EMBEDS}", "must be finite floats")


def cache_keys(items: Sequence[MultiModalItem], block_size: int, num_blocks: int) -> list[bytes]:
    """Per full block, what besides its tokens decides its k/v: the content hash of every
    item with placeholders in it (and where in the item the block starts)."""
    keys = []
    for b in range(num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        parts = [
            f"{item.content_hash}@{max(lo - item.offset, 0)}"
            for item in items
            if item.offset < hi and item.offset + item.length > lo
        ]
        keys.append(";".join(parts).encode())
    return keys
