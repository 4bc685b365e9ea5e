"""``Omni``: a synchronous, offline wrapper over ``AsyncOmni`` (like vLLM-Omni's ``Omni``).

It owns a private event loop on a background thread; every method blocks until done.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omnistage.config import PipelineConfig
from omnistage.engine.async_omni import AsyncOmni
from omnistage.engine.outputs import OmniAudio, OmniImage
from omnistage.entrypoints.media import MediaPolicy, has_media_parts, load_messages

T = TypeVar("T")


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
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompts: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        image_params: dict[str, Any] | None = None,
        talker_params: dict[str, Any] | None = None,
        audio_params: dict[str, Any] | None = None,
    ) -> list[OmniOutput]:
        """Run every prompt through the pipeline concurrently; results in input order
        (``modalities=["text", "audio"]`` on a speaking pipeline: ``OmniOutput.audio``)."""
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)

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
    ) -> list[dict[str, Any]]:
        return self._run(self.engine.wake_up(stage_ids, tags=tags, reload=reload))

    def pause_generation(self, stage_ids: Sequence[int] | None = None, mode: str = "abort") -> None:
        self._run(self.engine.pause_generation(stage_ids, mode=mode))

    def resume_generation(self, stage_ids: Sequence[int] | None = None) -> None:
        self._run(self.engine.resume_generation(stage_ids))

    def update_weights(self, stage_id: int, path: str) -> list[dict[str, Any]]:
        return self._run(self.engine.update_weights(stage_id, path))

    def stage_status(self) -> list[dict[str, Any]]:
        return self._run(self.engine.stage_status())

    def shutdown(self) -> None:
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
