"""Preparing a request's first stage off the event loop: prompts with media on a few
threads of their own (``RequestRouter.media_threads``), text prompts never behind them."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from omnistage.engine.router import RequestRouter


async def test_media_prompts_are_prepared_few_at_once_and_text_never_waits_for_them():
    router = RequestRouter(SimpleNamespace(stages=[]), [], None, None)  # type: ignore[arg-type]
    release, lock = threading.Event(), threading.Lock()
    running, most = [0], [0]

    def prepare(stage_id, prompt, options, chain):
        if not prompt.get("multi_modal_data"):
            return "text"
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return "media"

    router._prepare_request = prepare  # type: ignore[method-assign]
    media = [
        asyncio.ensure_future(router._prepare_first(0, {"multi_modal_data": [1]}, None, [0]))
        for _ in range(8)
    ]
    await asyncio.sleep(0.2)  # the first two hold their threads
    start = time.monotonic()
    assert await router._prepare_first(0, {"prompt": "hi"}, None, [0]) == "text"
    assert time.monotonic() - start < 1.0
    release.set()
    assert await asyncio.gather(*media) == ["media"] * 8
    assert most[0] == router.media_threads == 2
