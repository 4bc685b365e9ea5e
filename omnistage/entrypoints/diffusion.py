"""The offline Python API for one diffusion pipeline.

    pipe = Diffusion(model="path/to/diffusers-folder", enable_sleep_mode=True)
    images = pipe.generate(["a red cat"], DiffusionParams(seed=0))
    open("cat.png", "wb").write(images[0].png)
    pipe.sleep(level=2); pipe.wake_up()   # same seed -> same PNG bytes
    # a video family: an MP4 of its frames (1 + a multiple of the temporal compression)
    video = pipe.generate("a red cat", DiffusionParams(video=True, num_frames=33, seed=0))[0]

Inputs are prompts (strings) or conditioning embeddings (float tensors ``[seq, dim]``, e.g. a
thinker's final hidden states). As for every diffusion stage, ``wake_up`` resumes by itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.config import offline_stage_config
from omnistage.entrypoints.offline import params_per_input
from omnistage.errors import StageAsleepError
from omnistage.stage.control import acks_of
from omnistage.stage.diffusion.engine import DiffusionStageEngine
from omnistage.stage.diffusion.params import DiffusionParams, DiffusionRequest, ImageOutput
from omnistage.stage.diffusion.video import VideoOutput
from omnistage.stage.diffusion.wire import KIND

__all__ = ["Diffusion", "DiffusionParams", "ImageOutput", "VideoOutput"]

DiffusionInput = str | torch.Tensor


class Diffusion:
    """One diffusers-format pipeline in this process. Extra keywords are ``StageConfig``
    fields (``max_batch_size``, ``preset``, ...); others raise ``TypeError``."""

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        enable_sleep_mode: bool = True,
        **kwargs: Any,
    ) -> None:
        config = offline_stage_config(
            "Diffusion",
            KIND,
            str(model),
            device=device,
            dtype=dtype,
            enable_sleep_mode=enable_sleep_mode,
            **kwargs,
        )
        self.engine = DiffusionStageEngine(config)
        self._request_counter = itertools.count()

    def generate(
        self,
        inputs: DiffusionInput | Sequence[DiffusionInput],
        params: DiffusionParams | Sequence[DiffusionParams] | None = None,
    ) -> list[ImageOutput | VideoOutput]:
        """One image per input (a video with ``DiffusionParams(video=True)``), in input
        order. Raises ``InvalidRequestError`` (naming the field) before anything runs, and
        ``RuntimeError`` if a request fails or is aborted."""
        items = [inputs] if isinstance(inputs, str | torch.Tensor) else list(inputs)
        per_item = params_per_input(params, DiffusionParams, len(items), ("params", "inputs"))
        # Queued requests would never run: a level-0 sleep only pauses, so the engine would
        # queue them rather than refuse.
        if self.engine.is_sleeping():
            raise StageAsleepError(self.engine.stage_id)
        if self.engine.is_paused:
            raise RuntimeError("the pipeline is paused; call engine.resume() first")
        requests = [self._request(item, p) for item, p in zip(items, per_item, strict=True)]
        added: list[str] = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
        except Exception:
            self._abort(added)
            raise
        pending = set(added)
        results: dict[str, ImageOutput | VideoOutput] = {}
        while pending:
            for output in self.engine.step():
                if output.request_id not in pending:
                    continue
                pending.discard(output.request_id)
                if output.finish_reason != "stop" or not output.media:
                    self._abort(pending)  # the other inputs of this call must not linger
                    raise RuntimeError(
                        f"request {output.request_id} ended with {output.finish_reason}: "
                        f"{output.error or 'no image'}"
                    )
                results[output.request_id] = output.media[0]
        return [results[r.request_id] for r in requests]

    def _abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
        self.engine.step()  # collect the aborts so they do not leak into a later call

    def _request(self, item: DiffusionInput, params: DiffusionParams) -> DiffusionRequest:
        request_id = f"image-{next(self._request_counter)}"
        if isinstance(item, torch.Tensor):
            return DiffusionRequest(request_id, prompt_embeds=item, params=params)
        return DiffusionRequest(request_id, prompt=item, params=params)

    # -- control ----------------------------------------------------------------------------

    # Each returns the ACKs, one per rank (as ``AsyncOmni`` and the HTTP routes do).

    def sleep(self, level: int = 2, mode: str = "abort") -> list[dict[str, Any]]:
        return acks_of(self.engine.sleep(level=level, mode=mode))

    def wake_up(self, tags: list[str] | None = None, reload: bool = True) -> list[dict[str, Any]]:
        return acks_of(self.engine.wake_up(tags=tags, reload=reload))

    def update_weights(self, path: str | Path, check_finite: bool = True) -> list[dict[str, Any]]:
        return acks_of(self.engine.update_weights(path, check_finite=check_finite))

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def memory_stats(self) -> dict[str, Any]:
        return self.engine.sleep_control.memory_stats()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Diffusion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
