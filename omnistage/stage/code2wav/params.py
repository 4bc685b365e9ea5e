"""What a code2wav request asks for and what it returns; travels on the wire as is."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stage.media import OmniAudio

SEED_RANGE = (-(2**63), 2**64)
MAX_NUM_STEPS = 100
MAX_FIRST_CHUNK = 300  # frames: a decode window (``chunked_decode``'s 300)


class Code2WavParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``voice``: a speaker of the checkpoint's ``spk_dict.pt`` (None: the stage's default);
    ``seed``: the initial noise is ``torch.randn(shape, generator=torch.Generator("cpu")
    .manual_seed(seed))`` (transformers' draw after ``torch.manual_seed(seed)``), random when
    None; ``num_steps``, ``guidance_scale``, ``sway_coefficient``: the DiT's ODE solve, with
    transformers' defaults; ``context_frames``: the codes' first frames are context only (a
    cloned voice's reference, which the talker stage puts before its own): decoded with the
    rest, their samples dropped where the model's reference cuts a clone's;
    ``first_chunk``: a streamed utterance's first chunk goes out as soon as this many frames
    (after the context) have arrived, decoded from them alone — its samples are not final, so
    they may differ from the whole decode's; the rest are the exact ones (None: the stage's
    ``stream_chunks``, every chunk exact; ignored by a whole hand-off)."""

    voice: str | None = None
    seed: int | None = None
    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    context_frames: int = 0
    first_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.voice is not None and (not isinstance(self.voice, str) or not self.voice):
            raise InvalidRequestError("voice", "must be a non-empty string")
        seed = self.seed
        if seed is not None and (
            not isinstance(seed, int)
            or isinstance(seed, bool)
            or not SEED_RANGE[0] <= seed < SEED_RANGE[1]
        ):
            raise InvalidRequestError("seed", "must be an integer in [-2**63, 2**64) or None")
        steps = self.num_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 2 <= steps <= MAX_NUM_STEPS:
            raise InvalidRequestError(
                "num_steps", f"must be an integer in [2, {MAX_NUM_STEPS}], got {steps!r}"
            )
        frames = self.context_frames
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
            raise InvalidRequestError("context_frames", f"must be an integer >= 0, got {frames!r}")
        first = self.first_chunk
        if first is not None and (
            not isinstance(first, int)
            or isinstance(first, bool)
            or not 1 <= first <= MAX_FIRST_CHUNK
        ):
            raise InvalidRequestError(
                "first_chunk",
                f"must be an integer in [1, {MAX_FIRST_CHUNK}] or None, got {first!r}",
            )
        for name in ("guidance_scale", "sway_coefficient"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or abs(value) > 100:
                raise InvalidRequestError(
                    name, f"must be a finite number in [-100, 100], got {value!r}"
                )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Code2WavParams:
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                unknown[0], f"unknown audio parameter; known: {sorted(cls.__struct_fields__)}"
            )
        return cls(**data)


class AudioOutput(msgspec.Struct, tag="audio"):
    """A finished waveform: float32 samples in [-1, 1] (1-D, on the CPU) at ``sample_rate``."""

    samples: torch.Tensor
    sample_rate: int
    voice: str
    seed: int | None = None
    codes: list[int] = []  # the speech codes it speaks (what the upstream stage produced)
    compute_s: float = 0.0  # the stage's synthesis time for these samples

    def to_client(self) -> OmniAudio:
        return OmniAudio(
            samples=self.samples.numpy(),
            sample_rate=self.sample_rate,
            voice=self.voice,
            seed=self.seed,
            codes=list(self.codes),
        )


class Code2WavLimits(msgspec.Struct, frozen=True):
    """What the API process checks before a request reaches the stage."""

    voices: list[str]
    default_voice: str
    codebook_size: int  # codes are in [0, codebook_size)
    max_codes: int  # the most one utterance may have
    sample_rate: int
    codes_per_frame: int = 1  # codes come in whole frames of this many (one per codebook)
