"""Qwen3-Omni beside Qwen2.5-Omni (``bench omni``'s ``families`` table): each family's built-in
tiny pipeline served as it is by default (three stage processes, code2wav speaking the talker's
codes chunk by chunk: ``stream: true``), through ``AsyncOmni``, against transformers' own
``generate`` of the same family on the same folder in the same run.

Every request is one of ``bench omni``'s chat prompts answered with text and audio: greedy
thinker (``thinker_tokens``) and talker (``talker_tokens`` steps: codes for Qwen2.5-Omni,
frames of ``num_code_groups`` codes for Qwen3-Omni, whose tiny talker says its end code within
64 steps for some prompts and not for others), one voice (and for Qwen2.5-Omni's DiT one seed
and ``num_steps``). omnistage: after one warm-up request, the prompts go ``concurrency`` at
a time; ``ttfa_ms`` is a request's submission to its first audio piece, ``e2e_ms`` to its
end. transformers: the prompts one after another (it decodes one request at a time) in this
process after the pipeline has shut down, on one torch thread as each stage has
(``BASELINE_THREADS``); its audio comes whole, so its ``ttfa_ms`` is its ``e2e_ms``.
Qwen2.5-Omni's baseline is ``bench omni``'s runner with the talker's codec prefill restored
(transformers 5.x drops it: see ``omni``; it costs no time), so its codes are comparable;
``same_codes`` counts the requests whose speech codes equal transformers'.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.bench import omni_media as media
from omnistage.bench.report import write_results

QWEN2_5, QWEN3 = "tiny-qwen2.5-omni", "tiny-qwen3-omni"
PIPELINES = (QWEN2_5, QWEN3)
# fmt: off
COLUMNS = ["model", "engine", "concurrency", "requests", "audio_s", "seconds", "requests_per_s",
           "rtf", "ttfa_ms", "e2e_ms", "speedup_vs_transformers", "ttfa_vs_transformers",
           "same_codes"]
# fmt: on


@dataclass(frozen=True)
class Family:
    """How one family's requests are asked for."""

    model: str  # the table's name for it
    voice: str
    ode: bool  # its code2wav solves an ODE from seeded noise (a seed and num_steps)


FAMILIES = {
    QWEN2_5: Family("Qwen2.5-Omni", "Chelsie", ode=True),
    QWEN3: Family("Qwen3-Omni", "chelsie", ode=False),
}
SEED = 7  # bench omni's
# transformers' baseline runs on one torch thread, as each stage process does: with two, on a
# machine whose cores other work also holds, its many small ops wait on a descheduled thread
# (several times slower, from run to run)
BASELINE_THREADS = 1


@dataclass
class Heard:
    """One request's outcome: speech codes, seconds of audio, time to first audio and to the
    end (seconds, from its submission)."""

    prompt: str
    codes: list[int]
    audio_s: float
    ttfa_s: float
    e2e_s: float


@dataclass
class Pass:
    """One engine's pass over the prompts at one concurrency: wall seconds, each request."""

    seconds: float
    heard: list[Heard]


def check_pipelines(pipelines: Sequence[str]) -> tuple[str, ...]:
    unknown = [p for p in pipelines if p not in FAMILIES]
    if unknown or not pipelines:
        raise ValueError(f"--pipelines: bench omni measures {list(PIPELINES)}, got {unknown}")
    return tuple(dict.fromkeys(pipelines))


def row(
    family: Family, engine: str, concurrency: int, run: Pass, baseline: Pass, codes: Pass
) -> dict[str, Any]:
    """One table row: ``run`` against transformers' ``baseline``; ``same_codes`` against
    ``codes`` (transformers' pass, prompt by prompt)."""
    audio_s = sum(h.audio_s for h in run.heard)
    ttfa = statistics.mean(h.ttfa_s for h in run.heard)
    base_ttfa = statistics.mean(h.ttfa_s for h in baseline.heard)
    theirs = {h.prompt: h.codes for h in codes.heard}
    same = sum(h.codes == theirs.get(h.prompt) for h in run.heard)
    return {
        "model": family.model,
        "engine": engine,
        "concurrency": concurrency,
        **media.speech_rate(len(run.heard), audio_s, run.seconds),
        "ttfa_ms": ttfa * 1e3,
        "e2e_ms": statistics.mean(h.e2e_s for h in run.heard) * 1e3,
        "speedup_vs_transformers": baseline.seconds / run.seconds,
        "ttfa_vs_transformers": ttfa / base_ttfa,
        "same_codes": f"{same}/{len(run.heard)}",
    }


# -- omnistage ------------------------------------------------------------------------------


async def _passes(pipeline: str, settings: Any, device: str, in_process: bool) -> dict[int, Pass]:
    from omnistage.engine.async_omni import AsyncOmni

    family = FAMILIES[pipeline]
    engine = AsyncOmni.from_pipeline(pipeline, device=device, in_process=in_process)
    sampling = {"temperature": 0.0, "max_tokens": settings.thinker_tokens}
    talker = {"temperature": 0.0, "max_tokens": settings.talker_tokens}
    audio: dict[str, Any] = {"voice": family.voice}
    if family.ode:
        audio |= {"seed": SEED, "num_steps": settings.num_steps}

    async def one(prompt: str) -> Heard:
        start = time.perf_counter()
        first, codes, samples = None, [], 0.0
        chat = {"messages": [{"role": "user", "content": prompt}]}
        async for out in engine.generate(
            chat, sampling, ["text", "audio"], talker_params=talker, audio_params=audio
        ):
            if first is None and (out.audio_delta or out.audio):
                first = time.perf_counter()
            for whole in out.audio:
                codes, samples = list(whole.codes), whole.duration_s
        end = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{pipeline}: request {prompt!r} gave no audio")
        return Heard(prompt, codes, samples, first - start, end - start)

    try:
        await one(settings.prompts[0])  # warm-up
        passes = {}
        for concurrency in settings.concurrency:
            heard: list[Heard] = []
            start = time.perf_counter()
            for i in range(0, len(settings.prompts), concurrency):
                batch = settings.prompts[i : i + concurrency]
                heard += await asyncio.gather(*(one(p) for p in batch))
            passes[concurrency] = Pass(time.perf_counter() - start, heard)
        return passes
    finally:
        engine.shutdown()


def omnistage_passes(
    pipeline: str, settings: Any, device: str, in_process: bool = False
) -> tuple[Path, dict[int, Pass]]:
    """The pipeline's folder (built here, untimed) and its pass at each concurrency."""
    from omnistage.pipelines import load_pipeline

    folder = Path(load_pipeline(pipeline, device=device).stages[0].model)
    return folder, asyncio.run(_passes(pipeline, settings, device, in_process))


# -- transformers -----------------------------------------------------------------------------


class Qwen3Transformers:
    """``Qwen3OmniMoeForConditionalGeneration.generate``, greedy, one prompt at a time; the
    codes are what it hands ``code2wav.chunked_decode``."""

    def __init__(self, folder: Path, settings: Any, device: str) -> None:
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

        self.settings, self.device = settings, device
        with media.quiet():
            model: Any = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                folder, dtype=torch.float32
            )
            self.model = model.to(device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def speak(self, prompt: str) -> Heard:
        s, model = self.settings, self.model
        chat = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        decode, seen = model.code2wav.chunked_decode, []

        def chunked_decode(codes: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(codes[0].T.reshape(-1).tolist())  # [G, frames] -> frame-major, flat
            return decode(codes, *args, **kwargs)

        start = time.perf_counter()
        with media.patched(model.code2wav, "chunked_decode", chunked_decode), media.quiet():
            _, waveform = media.greedy_speech(
                model,
                torch.tensor([ids], device=self.device),
                FAMILIES[QWEN3].voice,
                s,
                thinker_eos_token_id=model.config.im_end_token_id,
            )
        seconds = time.perf_counter() - start
        audio_s = waveform.numel() / 24000
        return Heard(prompt, seen[-1] if seen else [], audio_s, seconds, seconds)

    def run(self) -> Pass:
        with torch.no_grad():
            self.speak(self.settings.prompts[0])  # warm-up
            start = time.perf_counter()
            heard = [self.speak(p) for p in self.settings.prompts]
        return Pass(time.perf_counter() - start, heard)


def transformers_pass(
    pipeline: str, folder: Path, settings: Any, device: str, qwen2_5: Any = None
) -> Pass:
    """transformers' pass over the prompts, on ``BASELINE_THREADS`` torch threads;
    ``qwen2_5``: ``bench omni``'s runner class."""
    before = torch.get_num_threads()
    torch.set_num_threads(BASELINE_THREADS)
    try:
        if pipeline == QWEN3:
            return Qwen3Transformers(folder, settings, device).run()
        timed = qwen2_5(folder, settings, device).run(codec_prefill_embeds=True)
    finally:
        torch.set_num_threads(before)
    each = timed.seconds / len(timed.speech)  # one after another: the mean latency
    heard = [Heard(s.prompt, list(s.codes), s.duration_s, each, each) for s in timed.speech]
    return Pass(timed.seconds, heard)


def run(
    out_dir: str,
    name: str,
    pipelines: Sequence[str],
    settings: Any,
    device: str = "cpu",
    in_process: bool = False,
    qwen2_5: Any = None,
) -> str:
    """Write ``<name>-families.{json,md}``; return the table. ``settings``: ``bench omni``'s
    (prompts, thinker and talker tokens, ODE steps, concurrencies); ``qwen2_5``: its
    transformers runner (``omni.TransformersRunner``), for tiny-qwen2.5-omni."""
    rows = []
    for pipeline in check_pipelines(pipelines):
        family = FAMILIES[pipeline]
        folder, ours = omnistage_passes(pipeline, settings, device, in_process)
        theirs = transformers_pass(pipeline, folder, settings, device, qwen2_5)
        rows.append(row(family, "transformers", 1, theirs, theirs, theirs))
        rows += [row(family, "omnistage", c, ours[c], theirs, theirs) for c in sorted(ours)]
    return write_results(out_dir, name + "-families", rows, COLUMNS)
