"""What crosses the wire for a code2wav stage: its request, what it reports at start-up, and
the waveform it returns (``AudioOutput``, with the parameters in ``params``)."""

from __future__ import annotations

import msgspec

from omnistage.stage.code2wav.params import AudioOutput, Code2WavLimits, Code2WavParams

KIND = "code2wav"


class Code2WavStageRequest(msgspec.Struct, tag=KIND, forbid_unknown_fields=True):
    """Speech-codec tokens (without the end token) for a code2wav stage to speak."""

    codes: list[int]
    params: Code2WavParams = msgspec.field(default_factory=Code2WavParams)


class Code2WavStageInfo(msgspec.Struct, tag=KIND):
    """What the API process needs to validate requests for a code2wav stage."""

    limits: Code2WavLimits


# What the kinds map reads of this kind (``omnistage.stage.kinds``).
REQUEST, INFO, OUTPUT = Code2WavStageRequest, Code2WavStageInfo, AudioOutput

__all__ = ["KIND", "AudioOutput", "Code2WavStageInfo", "Code2WavStageRequest"]
