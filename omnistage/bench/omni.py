"""Qwen2.5-Omni (thinker → talker → code2wav) on the built-in ``tiny-qwen2.5-omni`` pipeline:
speech throughput against transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` in
the same run, whether the audio is the same, sleep/wake of each stage; and Qwen3-Omni beside
it (``omni_families``). docs/benchmarks.md says how to read the tables.

Every request is a chat prompt answered with text and audio: greedy thinker and talker (the
tiny random model reaches neither eos, so each request does the same work), one voice and
seed. Throughput: the stages are processes; prompts go ``concurrency`` at a time after a
warm-up. The baseline is transformers' ``generate`` on the same prompts one after another, in
this process, after the pipeline has shut down. ``rtf`` = wall seconds per second of audio.
``<stage>_ms``: mean time per request in a stage (omnistage: admission to the stage → its end
there, waiting included; transformers: inside ``thinker.generate``, ``talker.generate``,
``token2wav.forward``).

Audio: every request against the same prompt sent alone to omnistage, and against
transformers as shipped — whose 5.x ``generate`` drops an all-ones attention mask, so its
talker never adds the codec pad / bos embeddings to its prefill as the original Qwen code does
— and, untimed, with that mask handed back (as ``tests/qwen2_5_omni_reference.py`` does). Sleep:
per stage and level, medians over ``repeats`` cycles of sleep → wake (+ resume) → one audio
request through ``Omni``; the baseline is the pipeline's cold start to its first audio. Media
(``omni_media``): audio-in requests, the encoders, the encoder cache. Streamed speech
(``omni_stream``): time to first audio and throughput over HTTP, streamed and whole.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.bench import omni_families as families
from omnistage.bench import omni_media as media
from omnistage.bench import omni_stream
from omnistage.bench.report import write_results

PIPELINE = "tiny-qwen2.5-omni"
THINKER_TOKENS, TALKER_TOKENS, NUM_STEPS = 16, 64, 10
VOICE, SEED = "Chelsie", 7
STAGE_NAMES = ("thinker", "talker", "code2wav")  # the pipeline's stages, by name
CONCURRENCY = (1, 8)
MiB = 1 << 20
SAMPLE_RATE = 24000  # transformers' token2wav output
# fmt: off
PROMPTS = ("Hello there", "Tell me a story about a cat", "1 2 3", "What is the weather like today?",
           "Sing me a song", "Count to ten", "Why is the sky blue?", "Good night")
THROUGHPUT_COLUMNS = ["engine", "concurrency", "requests", "audio_s", "seconds", "requests_per_s",
                      "rtf", "speedup_vs_transformers", "thinker_ms", "talker_ms", "code2wav_ms"]
AUDIO_COLUMNS = ["compared", "against", "requests", "same_thinker_ids", "same_codes",
                 "same_length", "max_abs_diff_over_peak"]
SLEEP_COLUMNS = ["stage", "level", "sleep_ms", "wake_ms", "freed_mib", "resident_mib",
                 "audio_after_wake_ms", "same_audio", "cold_start_ms", "wake_speedup_vs_cold_start"]
SLEEP_TIMED = ("sleep_ms", "wake_ms", "freed_mib", "resident_mib", "audio_after_wake_ms",
               "sleep_ack_ms", "wake_ack_ms")  # medians; the last two are the ACKs' latency_ms
Request = Callable[[str], dict[str, Any]]  # a prompt's name -> Omni.generate's prompt
Inputs = Callable[[str], tuple[list[int], dict[str, Any]]]  # -> ids, generate's other inputs
# fmt: on


class OmniBenchError(RuntimeError):
    """A sleep or wake did not succeed, or a request gave no audio: nothing honest to report."""


@dataclass
class Settings:
    prompts: tuple[str, ...] = PROMPTS
    thinker_tokens: int = THINKER_TOKENS
    talker_tokens: int = TALKER_TOKENS
    num_steps: int = NUM_STEPS
    concurrency: tuple[int, ...] = CONCURRENCY
    repeats: int = 3
    stream_talker_tokens: int = 256  # the streamed-speech table's replies (the tiny cap)
    stream: bool = True  # measure streamed speech over HTTP (omni_stream)
    media: media.MediaSettings = field(default_factory=media.MediaSettings)


@dataclass
class Speech:
    """What one request gave: the thinker's ids, the speech codes and the waveform."""

    prompt: str
    thinker_ids: list[int]
    codes: list[int]
    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass
class Timed:
    """One engine's pass over the prompts: wall seconds, outputs in prompt order, and the
    per-request time in each stage (seconds, one list per stage name)."""

    seconds: float
    speech: list[Speech]
    stage_s: dict[str, list[float]] = field(default_factory=dict)


def compare(name: str, reference: Sequence[Speech], ours: Sequence[Speech]) -> dict:
    """One audio-table row: ``ours`` against ``reference`` (omnistage, each prompt alone):
    how many requests agree on thinker ids / codes / length, and the largest sample difference
    relative to the reference's peak over the requests of equal length (``None`` if none)."""
    pairs = list(zip(ours, reference, strict=True))
    diffs = [
        float(np.abs(a.samples - b.samples).max()) / (float(np.abs(b.samples).max()) or 1.0)
        for a, b in pairs
        if a.prompt == b.prompt and a.samples.shape == b.samples.shape
    ]

    def count(same: Callable[[Speech, Speech], bool]) -> str:
        return f"{sum(a.prompt == b.prompt and same(a, b) for a, b in pairs)}/{len(pairs)}"

    return {
        "compared": name,
        "against": "omnistage alone",
        "requests": len(pairs),
        "same_thinker_ids": count(lambda a, b: a.thinker_ids == b.thinker_ids),
        "same_codes": count(lambda a, b: a.codes == b.codes),
        "same_length": count(lambda a, b: a.samples.shape == b.samples.shape),
        "max_abs_diff_over_peak": max(diffs) if diffs else None,
    }


def identical(a: Speech, b: Speech) -> bool:
    same_ids = a.thinker_ids == b.thinker_ids and a.codes == b.codes
    return same_ids and a.samples.shape == b.samples.shape and bool((a.samples == b.samples).all())


def throughput_row(engine: str, concurrency: int, run: Timed, baseline_s: float) -> dict:
    audio_s = sum(s.duration_s for s in run.speech)
    row: dict[str, Any] = {
        "engine": engine,
        "concurrency": concurrency,
        **media.speech_rate(len(run.speech), audio_s, run.seconds),
        "speedup_vs_transformers": baseline_s / run.seconds,
    }
    for stage in (*STAGE_NAMES, "processor"):
        times = run.stage_s.get(stage)
        row[f"{stage}_ms"] = statistics.mean(times) * 1e3 if times else None
    return row


def sleep_row(stage: str, level: int, cycles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timings; ``same_audio`` only if it held after every wake."""
    row: dict[str, Any] = {"stage": stage, "level": level}
    for key in SLEEP_TIMED:
        row[key] = statistics.median(c[key] for c in cycles)
    row["same_audio"] = all(c["same_audio"] for c in cycles)
    return row


def add_cold_start(row: dict[str, Any], cold_ms: float) -> None:
    row["cold_start_ms"] = cold_ms
    row["wake_speedup_vs_cold_start"] = cold_ms / (row["wake_ms"] + row["audio_after_wake_ms"])


def _chat(prompt: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}]}


def _check(op: str, acks: list[dict[str, Any]]) -> dict[str, Any]:
    if not acks or any(a.get("status") != "SUCCESS" for a in acks):
        raise OmniBenchError(f"{op} did not succeed: {acks}")
    return acks[0]


class OmnistageRunner:
    """The pipeline behind ``Omni``, with every stage's per-request time recorded."""

    def __init__(self, settings: Settings, device: str, in_process: bool = False) -> None:
        from omnistage.entrypoints.omni import Omni
        from omnistage.pipelines import load_pipeline

        self.settings = settings
        config = load_pipeline(PIPELINE, device=device)  # builds the checkpoint, untimed
        self.folder = Path(config.stages[0].model)
        start = time.perf_counter()
        self.omni = Omni.from_pipeline(  # speech in one piece: comparable with transformers
            PIPELINE, device=device, enable_sleep_mode=True, in_process=in_process, stream=False
        )
        try:
            self.stage_names = {s["stage_id"]: s["name"] for s in self.omni.stage_status()}
            self._stats: list[Any] = []
            self.omni.engine.add_request_listener(self._stats.append)
            self.speak(settings.prompts[:1])  # the first audio (and the warm-up)
        except BaseException:
            self.omni.shutdown()
            raise
        self.cold_start_ms = (time.perf_counter() - start) * 1e3

    def speak(self, prompts: Sequence[str], request: Request = _chat) -> list[Speech]:
        """Each prompt (by name) through ``request`` (name -> ``Omni.generate``'s prompt)."""
        s = self.settings
        outputs = self.omni.generate(
            [request(p) for p in prompts],
            {"temperature": 0.0, "max_tokens": s.thinker_tokens},
            ["text", "audio"],
            talker_params={"temperature": 0.0, "max_tokens": s.talker_tokens},
            audio_params={"voice": VOICE, "seed": SEED, "num_steps": s.num_steps},
        )
        speech = []
        for prompt, out in zip(prompts, outputs, strict=True):
            if len(out.audio) != 1:
                raise OmniBenchError(f"request {prompt!r} gave {len(out.audio)} waveforms")
            audio = out.audio[0]
            speech.append(
                Speech(prompt, list(out.token_ids), list(audio.codes), audio.samples,
                       audio.sample_rate)
            )  # fmt: skip
        return speech

    def timed(
        self, concurrency: int, prompts: Sequence[str] = (), request: Request = _chat
    ) -> Timed:
        prompts = prompts or self.settings.prompts
        self._stats.clear()
        speech: list[Speech] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            speech += self.speak(prompts[i : i + concurrency], request)
        seconds = time.perf_counter() - start
        stage_s: dict[str, list[float]] = {}
        for stats in list(self._stats):
            stage_s.setdefault(self.stage_names[stats.stage_id], []).append(stats.e2e_s)
        return Timed(seconds, speech, stage_s)

    def sleep_cycle(self, stage_id: int, level: int, reference: Speech) -> dict[str, Any]:
        status = {s["stage_id"]: s for s in self.omni.stage_status()}[stage_id]
        resident = status.get("memory", {}).get("resident_bytes", 0)
        name = self.stage_names[stage_id]
        start = time.perf_counter()
        slept = _check(f"{name} sleep level {level}", self.omni.sleep([stage_id], level=level))
        asleep = time.perf_counter()
        woke = _check(f"{name} wake after level {level}", self.omni.wake_up([stage_id]))
        if woke["metadata"]["paused"]:  # a stage that waits for a resume after a wake
            self.omni.resume_generation([stage_id])
        awake = time.perf_counter()
        (after,) = self.speak([reference.prompt])
        done = time.perf_counter()
        return {
            "sleep_ms": (asleep - start) * 1e3,
            "wake_ms": (awake - asleep) * 1e3,
            "freed_mib": slept["freed_bytes"] / MiB,
            "resident_mib": resident / MiB,
            "audio_after_wake_ms": (done - awake) * 1e3,
            "sleep_ack_ms": slept["metadata"]["latency_ms"],
            "wake_ack_ms": woke["metadata"]["latency_ms"],
            "same_audio": identical(after, reference),
        }

    def sleep_rows(self, reference: Speech) -> list[dict[str, Any]]:
        rows = []
        for (stage_id, name), level in itertools.product(sorted(self.stage_names.items()), (1, 2)):
            cycles = [
                self.sleep_cycle(stage_id, level, reference) for _ in range(self.settings.repeats)
            ]
            rows.append(sleep_row(f"{stage_id} ({name})", level, cycles))
            add_cold_start(rows[-1], self.cold_start_ms)
        return rows

    def shutdown(self) -> None:
        self.omni.shutdown()


class TransformersRunner:
    """``Qwen2_5OmniForConditionalGeneration.generate`` one prompt at a time, greedy, with
    the time spent in each part recorded."""

    def __init__(self, folder: Path, settings: Settings, device: str) -> None:
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        self.settings, self.device = settings, device
        with media.quiet():
            model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
            self.model = model.to(device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        talker = self.model.config.talker_config
        self.codec_stops = [talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id]
        self.codes: list[list[int]] = []

    def _text(self, prompt: str) -> tuple[list[int], dict[str, Any]]:
        text = self.tokenizer.apply_chat_template(
            _chat(prompt)["messages"], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], {}

    def _generate(self, prompt: str, inputs: Inputs) -> Speech:
        s = self.settings
        ids, more = inputs(prompt)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        torch.manual_seed(SEED)  # token2wav's noise is the first draw after it
        sequences, waveform = media.greedy_speech(
            self.model,
            input_ids,
            VOICE,
            s,
            talker_eos_token_id=self.codec_stops,
            token2wav_num_steps=s.num_steps,
            **more,
        )
        samples = waveform.detach().float().cpu().numpy().astype(np.float32).reshape(-1)
        thinker_ids = sequences[0, len(ids) :].tolist()
        return Speech(prompt, thinker_ids, self.codes[-1], samples, SAMPLE_RATE)

    def run(
        self,
        codec_prefill_embeds: bool = False,
        prompts: Sequence[str] = (),
        inputs: Inputs | None = None,
    ) -> Timed:
        """Every prompt (by name; ``inputs``: name -> prompt ids and ``generate``'s other
        inputs), one after another, after a warm-up; ``codec_prefill_embeds`` hands the
        talker's forward the all-ones mask transformers 5.x drops (module docstring)."""
        model, prompts = self.model, prompts or self.settings.prompts
        stage_s: dict[str, list[float]] = {name: [] for name in (*STAGE_NAMES, "processor")}
        talker_generate, talker_forward = model.talker.generate, model.talker.forward

        def timed(stage: str, f: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(f)  # generate inspects the forward's signature
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                result = f(*args, **kwargs)
                stage_s[stage].append(time.perf_counter() - start)
                return result

            return wrapper

        def talker(*args: Any, **kwargs: Any) -> Any:
            result = timed("talker", talker_generate)(*args, **kwargs)
            sequence = result[0, kwargs["input_ids"].shape[1] :].tolist()
            stops = [i for i, c in enumerate(sequence) if c in self.codec_stops]
            self.codes.append(sequence[: stops[0]] if stops else sequence)
            return result

        @functools.wraps(talker_forward)
        def talker_with_mask(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("attention_mask") is None:
                cache = kwargs.get("cache")
                past = cache.get_seq_length() if cache is not None else 0
                embeds = kwargs.get("inputs_embeds")
                batch, new = (embeds if embeds is not None else kwargs["input_ids"]).shape[:2]
                kwargs["attention_mask"] = torch.ones(
                    batch, past + new, dtype=torch.long, device=self.device
                )
            return talker_forward(*args, **kwargs)

        forward = talker_with_mask if codec_prefill_embeds else talker_forward
        with (
            media.patched(model.thinker, "generate", timed("thinker", model.thinker.generate)),
            media.patched(model.talker, "generate", talker),
            media.patched(model.talker, "forward", forward),
            media.patched(model.token2wav, "forward", timed("code2wav", model.token2wav.forward)),
            media.quiet(),
            torch.no_grad(),
        ):
            make = timed("processor", inputs or self._text)
            self._generate(prompts[0], make)  # warm-up
            for times in stage_s.values():
                times.clear()
            start = time.perf_counter()
            speech = [self._generate(p, make) for p in prompts]
            seconds = time.perf_counter() - start
        return Timed(seconds, speech, stage_s)


def run(out_dir: str, device: str = "cpu", settings: Settings | None = None, in_process: bool = False,
        pipelines: Sequence[str] = families.PIPELINES) -> str:  # fmt: skip
    """Write and return the tables: tiny-qwen2.5-omni's, and ``omni_families``' when
    tiny-qwen3-omni is chosen. ``in_process``: stages as threads (tests; here processes)."""
    s = settings or Settings()
    if s.repeats < 1 or not s.prompts or 1 not in s.concurrency or min(s.concurrency) < 1:
        raise ValueError(f"need repeats >= 1, prompts and concurrency 1 (and >= 1): {s}")
    name, chosen = f"omni-{device.replace(':', '')}", families.check_pipelines(pipelines)
    tables = [_qwen2_5(out_dir, name, s, device, in_process)] if PIPELINE in chosen else []
    if families.QWEN3 in chosen:  # Qwen3-Omni beside Qwen2.5-Omni (if chosen too)
        tables.append(families.run(out_dir, name, chosen, s, device, in_process, TransformersRunner))  # fmt: skip
    return "\n\n".join(tables)


def _qwen2_5(out_dir: str, name: str, s: Settings, device: str, in_process: bool) -> str:
    import transformers

    ours = OmnistageRunner(s, device, in_process=in_process)
    try:
        heard = media.AudioRequests(ours.folder, s.prompts, s.media)
        runs = {c: ours.timed(c) for c in s.concurrency}
        alone = runs[1].speech
        ours.speak(heard.names[:1], heard.omnistage("warm-up"))
        runs_in = {c: ours.timed(c, heard.names, heard.omnistage(f"x{c}")) for c in s.concurrency}
        cache_rows = media.cache_rows(ours.omni, s.media)
        sleep_rows = ours.sleep_rows(alone[0])
    finally:
        ours.shutdown()
    sleep_table = write_results(out_dir, name + "-sleep", sleep_rows, SLEEP_COLUMNS)

    theirs = TransformersRunner(ours.folder, s, device)
    baseline = theirs.run()
    restored = theirs.run(codec_prefill_embeds=True)  # untimed: only its outputs are used
    baseline_in = theirs.run(True, heard.names, heard.transformers)  # outputs comparable
    media_rows = media.throughput_rows(throughput_row, baseline_in, runs_in)
    encoder_rows = media.encoder_rows(ours.folder, theirs.model, s.media, device)
    rows = [throughput_row("transformers", 1, baseline, baseline.seconds)]
    rows += [throughput_row("omnistage", c, runs[c], baseline.seconds) for c in s.concurrency]
    audio = [compare(f"omnistage x{c}", alone, runs[c].speech) for c in s.concurrency if c > 1]
    audio += [
        compare(f"transformers {transformers.__version__} as shipped", alone, baseline.speech),
        compare("transformers + codec prefill embeds", alone, restored.speech),
    ]
    throughput_table = write_results(out_dir, name + "-throughput", rows, THROUGHPUT_COLUMNS)
    stream_tables = [omni_stream.run(out_dir, name, s, device, theirs)] if s.stream else []
    audio_table = write_results(out_dir, name + "-audio", audio, AUDIO_COLUMNS)
    tables = [throughput_table, *stream_tables, audio_table, sleep_table]
    tables += media.write_tables(out_dir, name, media_rows, encoder_rows, cache_rows)
    return "\n\n".join(tables)
