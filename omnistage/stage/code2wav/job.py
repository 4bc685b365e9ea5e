"""A code2wav job: one request's utterance, synthesised a step at a time by the vocoder of the
stage's model family (``vocoder.synthesis(codes, params, seed)``: ``advance()`` one step,
``is_done``, ``waveform()``), so the engine can interleave several utterances and check for
aborts between steps. ``finish()`` hands back the request's ``AudioOutput``."""

from __future__ import annotations

import time
from typing import Any

import torch

from omnistage.stage.code2wav.params import AudioOutput
from omnistage.stage.code2wav.request import Code2WavRequest


class _OneUtterance:
    """What both jobs share: one request, its seed, the synthesis time not yet reported, and
    leaving the job on an abort. ``target``: what the vocoder's ``advance_together`` steps."""

    target: Any

    def __init__(self, vocoder: Any, request: Code2WavRequest, seed: int) -> None:
        self.vocoder = vocoder
        self.request = request
        self.seed = seed
        self._dropped = False
        self.compute_s = 0.0

    @property
    def request_ids(self) -> list[str]:
        return [] if self._dropped else [self.request.request_id]

    @property
    def batch_key(self) -> Any:
        return None if self._dropped else self.target.batch_key

    def drop(self, request_id: str) -> Code2WavRequest | None:
        if self._dropped or request_id != self.request.request_id:
            return None
        self._dropped = True
        return self.request

    def _step(self) -> None:
        started = time.perf_counter()
        self.vocoder.advance_together([self.target])
        self.compute_s += time.perf_counter() - started


class Code2WavJob(_OneUtterance):
    @torch.inference_mode()
    def __init__(self, vocoder: Any, request: Code2WavRequest, seed: int) -> None:
        super().__init__(vocoder, request, seed)
        self.synthesis = self.target = vocoder.synthesis(request.codes, request.params, seed)

    @property
    def is_done(self) -> bool:
        return bool(self.synthesis.is_done)

    def advance(self) -> None:
        self._step()

    def finish(self) -> list[tuple[Code2WavRequest, AudioOutput]]:
        started = time.perf_counter()
        samples = self.synthesis.waveform()
        output = AudioOutput(
            samples=samples,
            sample_rate=self.vocoder.sample_rate,
            voice=self.synthesis.voice,
            seed=self.seed,
            codes=list(self.request.codes),
            compute_s=self.compute_s + time.perf_counter() - started,
        )
        return [(self.request, output)]


def synthesize(vocoder: Any, request: Code2WavRequest, seed: int) -> AudioOutput:
    """One request's waveform, all steps at once."""
    job = Code2WavJob(vocoder, request, seed)
    while not job.is_done:
        job.advance()
    return job.finish()[0][1]


class StreamingCode2WavJob(_OneUtterance):
    """A streamed request's utterance, spoken chunk by chunk as its codes arrive (the
    vocoder's ``streaming_synthesis``): it waits while a chunk's codes are not all in
    (``is_ready``), hands out each chunk's samples when they are done (``take_partial``), and
    its last output carries the rest with the utterance's seed, voice and codes."""

    def __init__(self, vocoder: Any, request: Code2WavRequest, seed: int, chunks: Any) -> None:
        super().__init__(vocoder, request, seed)
        self.stream = self.target = vocoder.streaming_synthesis(request.params, seed, chunks)
        self.stream.add_codes(list(request.codes))
        if request.input_ended:
            self.stream.end_input()

    @property
    def is_ready(self) -> bool:
        return not self._dropped and bool(self.stream.is_ready)

    @property
    def is_done(self) -> bool:
        return bool(self.stream.is_done)

    def add_input(self, codes: list[int], final: bool) -> None:
        self.stream.add_codes(codes)
        self.request.codes.extend(codes)
        if final:
            self.request.input_ended = True
            self.stream.end_input()

    def advance(self) -> None:
        if self.stream.is_ready:
            self._step()

    def _output(self, samples: torch.Tensor, *, last: bool) -> AudioOutput:
        compute_s, self.compute_s = self.compute_s, 0.0
        return AudioOutput(
            samples=samples,
            sample_rate=self.vocoder.sample_rate,
            voice=self.stream.voice,
            seed=self.seed,
            codes=list(self.request.codes) if last else [],
            compute_s=compute_s,
        )

    def take_partial(self) -> list[tuple[Code2WavRequest, AudioOutput]]:
        if self.is_done:
            return []  # ``finish`` hands out the rest
        samples = self.stream.take_audio()
        return [] if samples is None else [(self.request, self._output(samples, last=False))]

    def finish(self) -> list[tuple[Code2WavRequest, AudioOutput]]:
        samples = self.stream.take_audio()
        if samples is None:
            samples = torch.zeros(0, dtype=torch.float32)
        return [(self.request, self._output(samples, last=True))]
