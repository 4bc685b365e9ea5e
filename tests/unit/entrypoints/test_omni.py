"""The synchronous ``Omni`` wrapper: its own lifecycle, and a Python API that keeps the
server's word — text unless asked, the server's keywords, errors that name the keyword or
method, and a quiet shutdown (the engine is a stand-in where a real one is not needed)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from omnistage.entrypoints.omni import Omni
from omnistage.errors import (
    SleepModeDisabledError,
    StageAsleepError,
    StagePausedError,
    WeightsInvalidError,
)

ROOT = Path(__file__).resolve().parents[3]


class StandInEngine:
    """What ``Omni`` calls of an ``AsyncOmni``: records the modalities asked for, raises
    ``error`` if given, or (``hang``) never answers."""

    def __init__(self, outputs=("text", "image"), error=None, hang=False) -> None:
        self.outputs, self.error, self.hang = list(outputs), error, hang
        self.asked: list = []

    def output_modalities(self) -> list[str]:
        return self.outputs

    def generate(self, prompt, sampling_params=None, modalities=None, **params):
        self.asked.append(modalities)
        return self._stream()

    async def _stream(self):
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return
        yield

    async def sleep(self, stage_ids, level=2, mode="abort", tags=None):
        raise self.error

    def shutdown(self) -> None:
        pass


def test_shutdown_releases_the_private_event_loop():
    process = psutil.Process()
    Omni(StandInEngine()).shutdown()  # warm-up: lazily opened descriptors
    before = process.num_fds()
    for _ in range(5):
        Omni(StandInEngine()).shutdown()
    assert process.num_fds() == before


def test_text_unless_asked_as_the_servers_chat_route():
    engine = StandInEngine()
    with Omni(engine) as omni:  # type: ignore[arg-type]
        omni.generate("hi")
        omni.generate("hi", modalities=["text", "image"])
    assert engine.asked == [["text"], ["text", "image"]]
    images_only = StandInEngine(outputs=["image"])
    with Omni(images_only) as omni:  # type: ignore[arg-type]
        omni.generate("draw")
    assert images_only.asked == [None]  # a pipeline without text answers what it makes


@pytest.mark.parametrize(
    "error, says",
    [
        (SleepModeDisabledError(1), "enable_sleep_mode=True"),
        (StageAsleepError([0, 1]), "omni.wake_up([0, 1])"),
        (StagePausedError(0), "omni.resume_generation([0])"),
        (WeightsInvalidError(0), "omni.update_weights(0, path)"),
    ],
)
def test_errors_name_the_python_keyword_or_method(error, says):
    with Omni(StandInEngine(error=error)) as omni:  # type: ignore[arg-type]
        for call in (lambda: omni.generate("hi"), lambda: omni.sleep([1])):
            with pytest.raises(type(error)) as info:
                call()
            assert says in str(info.value)
            assert "--" not in str(info.value) and "/v1/" not in str(info.value)
            assert info.value.stage_id == error.stage_id


def test_a_call_waiting_at_shutdown_ends_with_an_error():
    omni = Omni(StandInEngine(hang=True))  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            omni.generate("hi")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)
    omni.shutdown()
    waiting.join(10)
    assert isinstance(raised[0], RuntimeError) and "shut down" in str(raised[0])
    with pytest.raises(RuntimeError, match="shut down"):
        omni.generate("hi")
    omni.shutdown()  # twice: nothing happens


def test_a_real_pipeline_answers_text_by_default_and_takes_kv_cache_memory():
    with Omni.from_pipeline("tiny-omni", in_process=True, kv_cache_memory="8MiB") as omni:
        assert omni.engine.config.stages[0].ar.kv_cache_memory == 8 << 20
        # seeded, and ignore_eos: a draw of the random model's end token would end it early
        (text,) = omni.generate("hi", {"max_tokens": 4, "ignore_eos": True, "seed": 0})
        assert text.text and not text.images and text.finish_reason == "length"
        params = {"num_inference_steps": 2, "height": 64, "width": 64}
        (both,) = omni.generate("hi", {"max_tokens": 4}, ["text", "image"], image_params=params)
        assert len(both.images) == 1


SCRIPT = textwrap.dedent(
    """
    import logging
    from omnistage import Omni

    logging.basicConfig(level=logging.DEBUG)
    try:
        with Omni.from_pipeline("tiny-chat") as omni:
            omni.generate("hi", {"max_tokens": 2})
            raise ValueError("left by an exception")
    except ValueError:
        pass
    omni = Omni.from_pipeline("tiny-omni")  # never shut down: the program ends by an exception
    omni.generate("hi", {"max_tokens": 2})
    raise KeyError("the end")
    """
)


def test_leaving_an_omni_is_quiet():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "KeyError: 'the end'" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("Traceback") == 1, done.stderr[-3000:]  # the program's own end
    for noise in ("died", "restarting", "Task was destroyed"):
        assert noise not in done.stderr, done.stderr[-3000:]
