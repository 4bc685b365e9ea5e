"""``Omni``: a synchronous, offline wrapper over ``AsyncOmni`` (like vLLM-Omni's ``Omni``).

It owns a private event loop on a background thread; every method blocks until done. As the
server: a wake serves again (``wake_up`` resumes what it woke, as the wakeup route), a request
for a paused stage waits at most ``paused_request_timeout_s``, keywords are the server's flags'
names (``enable_sleep_mode``, ``kv_cache_memory``, ...), and errors name the Python keyword or
method where the engine's name a flag or a route. ``generate`` answers text unless
``modalities`` asks for more. It shuts down quietly: at ``shutdown()``, on leaving a ``with`` block (an exception
too), or at interpreter exit if neither came first (before the stage processes are ended, so
that no stage is reported dead and restarted).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omnistage.config import PipelineConfig
from omnistage.engine.async_omni import AsyncOmni
from omnistage.engine.outputs import OmniAudio, OmniImage
from omnistage.entrypoints.llm_weights import reworded
from omnistage.entrypoints.media import MediaPolicy, has_media_parts, load_messages
from omnistage.errors import (
    SleepModeDisabledError,
    StageAsleepError,
    StagePausedError,
    WeightsInvalidError,
)

T = TypeVar("T")
# Engine errors whose words are the server's (a flag, a route): reworded for Python callers.
_REWORDED = (SleepModeDisabledError, StageAsleepError, StagePausedError, WeightsInvalidError)


@dataclass
class OmniOutput:
    """The whole result of one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    images: list[OmniImage] = field(default_factory=list)
    audio: list[OmniAudio] = field(default_factory=list)
    finish_reason: str | None = None


class Omni:
    def __init__(self, engine: AsyncOmni, media_policy: MediaPolicy | None = None) -> None:
        self.engine = engine
        # Where messages' media parts may come from and how large they may be (the server's
        # flags): data URLs only by default, as ``omnistage serve``.
        self.media_policy = media_policy or MediaPolicy()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="omni-loop", daemon=True
        )
        self._thread.start()
        self._closed = False
        # Before multiprocessing's own exit hook (registered earlier, so run later) ends the
        # stage processes: an Omni left open shuts down as if asked, not as stages dying.
        atexit.register(self.shutdown)

    @classmethod
    def from_config(cls, config: PipelineConfig, **options: Any) -> Omni:
        return cls(AsyncOmni.from_config(config, **options))

    @classmethod
    def from_model(cls, model: str, **overrides: Any) -> Omni:
        """See ``AsyncOmni.from_model`` (the pipeline the checkpoint's model family forms)."""
        return cls(AsyncOmni.from_model(model, **overrides))

    @classmethod
    def from_pipeline(cls, name: str, **overrides: Any) -> Omni:
        return cls(AsyncOmni.from_pipeline(name, **overrides))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("this Omni is shut down")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except _REWORDED as exc:
            raise _for_python(exc) from None
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RuntimeError("this Omni was shut down while the call ran") from None
            raise

    def generate(
        self,
        prompts: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        image_params: dict[str, Any] | None = None,
        talker_params: dict[str, Any] | None = None,
        audio_params: dict[str, Any] | None = None,
    ) -> list[OmniOutput]:
        """Run every prompt through the pipeline concurrently; results in input order.
        Text unless ``modalities`` asks for more, as the server's chat route
        (``["text", "audio"]`` on a speaking pipeline: ``OmniOutput.audio``; ``["text",
        "image"]``: ``OmniOutput.images``); a pipeline that makes no text answers what it
        makes."""
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if modalities is None and "text" in self.engine.output_modalities():
            modalities = ["text"]

        async def one(prompt: str | dict[str, Any]) -> OmniOutput:
            result = OmniOutput(request_id="")
            if isinstance(prompt, dict) and has_media_parts(prompt.get("messages")):
                # OpenAI's and vLLM's parts (input_audio, image_url, ...), as over HTTP.
                messages, media = await load_messages(
                    prompt["messages"], self.media_policy, prompt.get("mm_processor_kwargs")
                )
                prompt = {**prompt, "messages": messages, "multi_modal_data": media}
            async for out in self.engine.generate(
                prompt,
                sampling_params,
                modalities,
                image_params=image_params,
                talker_params=talker_params,
                audio_params=audio_params,
            ):
                result.request_id = out.request_id
                if out.modality == "text":
                    result.text += out.text_delta
                    result.token_ids.extend(out.new_token_ids)
                result.images.extend(out.images)
                result.audio.extend(out.audio)
                if out.final:
                    result.finish_reason = out.finish_reason
            return result

        async def run_all() -> list[OmniOutput]:
            return list(await asyncio.gather(*(one(p) for p in batch)))

        return self._run(run_all())

    def sleep(
        self,
        stage_ids: Sequence[int],
        level: int = 2,
        mode: str = "abort",
        tags: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        return self._run(self.engine.sleep(stage_ids, level=level, mode=mode, tags=tags))

    def wake_up(
        self,
        stage_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        reload: bool = True,
        resume: bool = True,
    ) -> list[dict[str, Any]]:
        """Wake the stages; they serve again, as after the server's wakeup route, unless
        ``resume=False`` (then ``resume_generation`` does it: ``AsyncOmni``'s default)."""
        return self._run(self.engine.wake_up(stage_ids, tags=tags, reload=reload, resume=resume))

    def pause_generation(self, stage_ids: Sequence[int] | None = None, mode: str = "abort") -> None:
        self._run(self.engine.pause_generation(stage_ids, mode=mode))

    def resume_generation(self, stage_ids: Sequence[int] | None = None) -> None:
        self._run(self.engine.resume_generation(stage_ids))

    def update_weights(self, stage_id: int, path: str) -> list[dict[str, Any]]:
        return self._run(self.engine.update_weights(stage_id, path))

    def stage_status(self) -> list[dict[str, Any]]:
        return self._run(self.engine.stage_status())

    def shutdown(self) -> None:
        """Stop every stage and the private loop, quietly; calls still waiting on the loop
        (another thread's ``generate``) end with ``CancelledError``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._thread.is_alive() and not self._loop.is_closed():
            # Requests in flight end now (aborted in their stages), before the stages go.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result(5)
        self.engine.shutdown()
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()  # its selector and self-pipe are file descriptors

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one, and let them unwind."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _for_python(exc: Exception) -> Exception:
    """An engine error worded for the server (a flag, a route) reworded for ``Omni``."""
    sid = getattr(exc, "stage_id", 0)
    if isinstance(exc, SleepModeDisabledError):
        return reworded(
            exc,
            f"stage {sid} was started without sleep mode; create the Omni with "
            "enable_sleep_mode=True (Omni.from_pipeline(name, enable_sleep_mode=True), "
            "Omni.from_model(path, enable_sleep_mode=True)) to use sleep",
        )
    if isinstance(exc, StageAsleepError):
        ids = list(getattr(exc, "stage_ids", [sid]))
        which = f"stage {ids[0]} is" if len(ids) == 1 else f"stages {ids} are"
        return reworded(
            exc,
            f"{which} asleep; wake with omni.wake_up({ids}) and retry (or create the Omni "
            "with auto_wake=True)",
        )
    if isinstance(exc, StagePausedError):
        return reworded(
            exc, f"stage {sid} is paused; resume it with omni.resume_generation([{sid}])"
        )
    return reworded(
        exc,
        f"stage {sid} has no valid weights: they were discarded by sleep(level=2) and woken "
        f"with reload=False; call omni.update_weights({sid}, path) or wake it with "
        "reload=True first",
    )
