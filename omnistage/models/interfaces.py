"""What a model family is to the rest of omnistage, as typed protocols: the registry hands out
a ``ModelFamily``; an AR stage needs an ``ARFamily``, a diffusion stage a ``DiffusionFamily``
(``omnistage.models.diffusion.family``, with its ``is_diffusion_family``), a code2wav stage a ``SupportsVocoder``; a family whose
thinker takes audio, pictures or video is ``SupportsMultiModal``. A family says what it can do
by deriving from the capability's protocol, and callers ask with the ``TypeIs`` helpers below —
never by looking an attribute up by name. (vLLM's ``model_executor/models/interfaces.py``
works the same way.)"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from typing_extensions import TypeIs

if TYPE_CHECKING:  # read before any model code loads (no torch at import)
    import torch

    from omnistage.models.ar_config import ARModelConfig
    from omnistage.models.decoder import CausalLM
    from omnistage.models.media import PromptProcessor
    from omnistage.models.tensor_parallel import TPGroup

Rename = Callable[[str], str | None]  # checkpoint name -> module name (None: not read)


@runtime_checkable
class ModelFamily(Protocol):
    """Every family: its registered name and the stages a folder of it is served as
    (``omnistage serve DIR``)."""

    name: str

    def pipeline(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class ARFamily(ModelFamily, Protocol):
    """A family served by AR stages: a decoder per part (``part``: ``model_stage``; None for a
    single-decoder checkpoint), its checkpoint renames, what its requests need."""

    def decoder_config(self, raw: dict[str, Any], part: str | None = None) -> ARModelConfig: ...

    def build_decoder(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> CausalLM:
        """The part's decoder on ``meta`` (adopt it into an arena, then load)."""
        ...

    def rename(self, part: str | None = None) -> Rename: ...

    def request_setup(self, config: ARModelConfig, folder: str) -> dict[str, Any]:
        """What a stage of this part asks of requests beyond its kind's defaults."""
        ...


@runtime_checkable
class SupportsMultiModal(ModelFamily, Protocol):
    """A family whose prompts carry audio, pictures or video: its processor of them."""

    def prompt_processor(self, folder: str | Path) -> PromptProcessor: ...


@runtime_checkable
class SupportsVocoder(ModelFamily, Protocol):
    """A family with a code-to-waveform part, run by a code2wav stage."""

    def vocoder(
        self, folder: str | Path, arena: Any, *, part: str | None = None, load: bool = True
    ) -> Any: ...


@runtime_checkable
class SupportsProcessors(ModelFamily, Protocol):
    """A family with its own stage-to-stage hand-offs: ``processors`` maps a short name to
    ``"module:attribute"`` of an ``InputProcessor``; a pipeline names it
    ``<family>.<short name>`` (the registry also keeps older unqualified names)."""

    processors: Mapping[str, str]


@dataclass(frozen=True)
class SpeechInput:
    """What a speech request asks (``/v1/audio/speech``): the text, the voice (None: the
    model's default), the language (None: the model picks), an instruction, the task (None:
    the checkpoint's), and whether the whole text goes into the prompt (None: the model's
    default). A cloned voice: ``ref_audio`` (mono float32 samples and their rate, already
    decoded), ``ref_text`` (what the clip says: the clone in context) or
    ``x_vector_only_mode`` (the clip's speaker embedding alone); or ``speaker_embedding``, that
    embedding given already (an x-vector clone without a clip)."""

    text: str
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    task_type: str | None = None
    non_streaming_mode: bool | None = None
    ref_audio: tuple[Any, int] | None = None  # (np.ndarray float32 [n], sampling rate)
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: tuple[float, ...] | None = None


@runtime_checkable
class SupportsSpeech(ModelFamily, Protocol):
    """A family that speaks a given text (a TTS model): the first stage's prompt for a speech
    request (``InvalidRequestError`` naming a bad field) and the voices it has. The prompt may
    carry ``request_params`` (what a later stage is told: a cloned voice's context frames, as
    ``audio_params``), which the router joins to the request's own."""

    def speech_prompt(
        self, folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
    ) -> dict[str, Any]: ...

    def speech_voices(self, folder: str) -> list[str]: ...


def is_ar_family(family: ModelFamily) -> TypeIs[ARFamily]:
    return isinstance(family, ARFamily)


def supports_multimodal(family: ModelFamily) -> TypeIs[SupportsMultiModal]:
    return isinstance(family, SupportsMultiModal)


def supports_vocoder(family: ModelFamily) -> TypeIs[SupportsVocoder]:
    return isinstance(family, SupportsVocoder)


def supports_processors(family: ModelFamily) -> TypeIs[SupportsProcessors]:
    return isinstance(family, SupportsProcessors)


def supports_speech(family: ModelFamily) -> TypeIs[SupportsSpeech]:
    return isinstance(family, SupportsSpeech)
