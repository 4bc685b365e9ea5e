"""A code2wav job: one request's utterance, synthesised a step at a time by the vocoder of the
stage's model family (``vocoder.synthesis(codes, params, seed)``: ``advance()`` one step,
``is_done``, ``waveform()``), so the engine can interleave several utterances and check for
aborts between steps. ``finish()`` hands back the request's ``AudioOutput``."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.stage.code2wav.params import AudioOutput
from omnistage.stage.code2wav.request import Code2WavRequest


class Code2WavJob:
    @torch.inference_mode()
    def __init__(self, vocoder: Any, request: Code2WavRequest, seed: int) -> None:
        self.vocoder = vocoder
        self.request = request
        self.seed = seed
        self._dropped = False
        self.synthesis = vocoder.synthesis(request.codes, request.params, seed)

    @property
    def request_ids(self) -> list[str]:
        return [] if self._dropped else [self.request.request_id]

    @property
    def is_done(self) -> bool:
        return bool(self.synthesis.is_done)

    def drop(self, request_id: str) -> Code2WavRequest | None:
        if self._dropped or request_id != self.request.request_id:
            return None
        self._dropped = True
        return self.request

    def advance(self) -> None:
        self.synthesis.advance()

    def finish(self) -> list[tuple[Code2WavRequest, AudioOutput]]:
        output = AudioOutput(
            samples=self.synthesis.waveform(),
            sample_rate=self.vocoder.sample_rate,
            voice=self.synthesis.voice,
            seed=self.seed,
            codes=list(self.request.codes),
        )
        return [(self.request, output)]


def synthesize(vocoder: Any, request: Code2WavRequest, seed: int) -> AudioOutput:
    """One request's waveform, all steps at once."""
    job = Code2WavJob(vocoder, request, seed)
    while not job.is_done:
        job.advance()
    return job.finish()[0][1]
