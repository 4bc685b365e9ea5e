"""``DiffusionFamily``: what the generic diffusion stage asks of a model family.

A diffusion family serves the pipeline folders whose ``model_index.json`` names one of its
``_class_name``s (the registry's ``pipeline_classes``) and exposes a ``FAMILY`` object with
this interface. The stage owns batching, per-request schedulers, the step interleaving and
the PNG; the family owns everything model-specific: which components it needs, how text
becomes conditioning, the shape of the latents and how they are drawn, how a scheduler's
timesteps are set (dynamic-shift ``mu``), the denoiser's call with classifier-free guidance,
and the VAE decode.

The family is stateless: every method takes the ``LoadedPipeline`` its ``build`` returned.
Requests and their params come from the stage; the family reads them through
``DiffusionRequestLike`` / ``DiffusionParamsLike`` (attributes only, no stage import).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from typing_extensions import TypeIs

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models.diffusion.pipeline import LoadedPipeline
from omnistage.models.family import load_template
from omnistage.models.interfaces import ModelFamily


@dataclass(frozen=True)
class DiffusionLimits:
    """What a loaded pipeline accepts (the stage adds its own caps on top)."""

    size_multiple: int  # height and width must be multiples of it
    embedding_dim: int  # the width of prompt embeddings ``[seq, dim]`` it takes
    has_text_encoder: bool  # whether text prompts work, or only embeddings
    native_size: int  # height (and width, unless ``native_width``) when a request gives none
    max_inference_steps: int  # the scheduler's training timesteps
    takes_prompt_embeds: bool = True  # False: text prompts only (pooled embeddings needed)
    takes_negative_prompt: bool = True  # False: guidance is distilled into the denoiser
    takes_scheduler_override: bool = True  # False: its timesteps need its own scheduler
    max_sequence_length: int = 4096  # the most text tokens its encoder is given
    max_frames: int = 1  # more than 1: a video family
    frame_step: int = 1  # a video's frame count is 1 + a multiple of it (temporal compression)
    default_frames: int = 1  # frames when a video request gives none
    default_fps: int = 16  # a video's frame rate when a request gives none
    native_width: int | None = None  # width when a request gives none, if not native_size
    default_guidance_scale: float = 1.0  # what the family's pipeline defaults to
    max_side: int | None = None  # the longest side its denoiser's positions reach, if bounded
    # Other names diffusers' pipeline class gives a parameter (vLLM-Omni's clients send them):
    # e.g. Qwen-Image's CFG scale is its ``true_cfg_scale`` -> ``guidance_scale``.
    param_aliases: Mapping[str, str] = field(default_factory=dict)


class DiffusionParamsLike(Protocol):
    """The per-request settings a family reads (the stage's ``DiffusionParams``)."""

    @property
    def num_inference_steps(self) -> int: ...
    @property
    def height(self) -> int | None: ...
    @property
    def width(self) -> int | None: ...
    @property
    def guidance_scale(self) -> float: ...
    @property
    def negative_prompt(self) -> str: ...
    @property
    def max_sequence_length(self) -> int | None: ...
    @property
    def num_frames(self) -> int | None: ...
    @property
    def uses_guidance(self) -> bool: ...


class DiffusionRequestLike(Protocol):
    """One request as a family reads it (the stage's ``DiffusionRequest``): a text prompt or
    embeddings ``[seq, dim]``, optional negative embeddings, and its params."""

    @property
    def prompt(self) -> str | None: ...
    @property
    def prompt_embeds(self) -> torch.Tensor | None: ...
    @property
    def negative_prompt_embeds(self) -> torch.Tensor | None: ...
    @property
    def params(self) -> DiffusionParamsLike: ...


@dataclass(frozen=True)
class NoiseQuery:
    """What ``predict_noise`` is asked for one denoising step of a batch: ``latents`` one row
    per request (already through the scheduler's ``scale_model_input``), ``timestep`` a
    scalar tensor, ``conditioning`` (what ``encode`` returned) and ``guidance_scales`` one
    per row."""

    latents: torch.Tensor
    timestep: torch.Tensor
    conditioning: Sequence[Any]
    guidance_scales: Sequence[float]


@runtime_checkable
class DiffusionFamily(Protocol):
    """A diffusion model family. ``Conditioning`` (what ``encode`` returns) is the family's
    own type: the stage keeps it per request and hands it back to ``predict_noise``."""

    name: str

    def build(
        self, folder: str | Path, arena: Arena, dtype: str = "float32", *, load: bool = True
    ) -> LoadedPipeline:
        """The folder's pipeline in ``arena`` (``CheckpointError`` for a folder the family
        cannot serve); its weights read unless ``load`` is False."""
        ...

    def limits(self, pipeline: LoadedPipeline) -> DiffusionLimits: ...

    def pipeline(self) -> list[dict[str, Any]]:
        """The stages a folder of this family is served as (``omnistage serve DIR``)."""
        ...

    def batch_key(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Hashable:
        """Requests with equal keys can share one denoising loop: same latent shape, same
        timesteps (besides the scheduler class, which the stage adds), same guidance rows."""
        ...

    def encode(self, pipeline: LoadedPipeline, request: DiffusionRequestLike) -> Any:
        """The request's conditioning as diffusers' pipeline builds it: its text or given
        embeddings and, when guidance runs, the unconditional input (negative prompt or
        negative embeddings). One request at a time, so it never depends on batch-mates."""
        ...

    def set_timesteps(
        self, pipeline: LoadedPipeline, scheduler: Any, request: DiffusionRequestLike
    ) -> None:
        """Set a fresh scheduler's timesteps for the request (where a family computes a
        dynamic-shift ``mu`` from the request's size)."""
        ...

    def prepare_latents(
        self, pipeline: LoadedPipeline, request: DiffusionRequestLike, seed: int, scheduler: Any
    ) -> torch.Tensor:
        """The request's initial latents, batch dimension 1, on the pipeline's device: drawn
        by a CPU ``torch.Generator`` seeded with ``seed`` (diffusers' draw with a list of
        generators), scaled as the family's pipeline does for ``scheduler``."""
        ...

    def predict_noise(self, pipeline: LoadedPipeline, query: NoiseQuery) -> torch.Tensor:
        """The denoiser's prediction for a batch (see ``NoiseQuery``). Classifier-free
        guidance runs batched, each row with its own scale. Returns a tensor shaped like
        ``query.latents``."""
        ...

    def decode(self, pipeline: LoadedPipeline, latents: torch.Tensor) -> torch.Tensor:
        """One request's final latents (batch dimension 1) to float pixels ``[H, W, 3]`` in
        [0, 1], on the CPU; a video family's to frames ``[F, H, W, 3]``."""
        ...


class FamilyBase(DiffusionFamily):
    """The ``build`` and ``pipeline`` the families share, set by class attributes: the
    components a folder must have, the scheduler classes served (any when empty; else
    ``CheckpointError`` naming ``label``), and the family's own refusals (``check``). A
    subclass is a ``DiffusionFamily`` by name: mypy checks its methods against the protocol's
    and refuses to instantiate one that lacks any."""

    name: str
    required: tuple[str, ...] = ("transformer", "vae")
    label = ""
    schedulers: tuple[str, ...] = ()
    component_tags = True
    template = "image.yaml"

    def check(self, pipeline: LoadedPipeline) -> None:
        """Raise ``CheckpointError`` for a folder the family cannot serve."""

    def build(
        self, folder: str | Path, arena: Arena, dtype: str = "float32", *, load: bool = True
    ) -> LoadedPipeline:
        pipeline = LoadedPipeline(
            folder,
            arena,
            dtype,
            required=self.required,
            load=False,
            component_tags=self.component_tags,
        )
        schedulers = self.schedulers
        if schedulers and pipeline.scheduler_class_name not in schedulers:
            wanted = schedulers[0] if len(schedulers) == 1 else f"one of {list(schedulers)}"
            raise CheckpointError(
                f"{pipeline.folder}/scheduler: {self.label} needs {wanted}, "
                f"got {pipeline.scheduler_class_name}"
            )
        self.check(pipeline)
        if load:
            pipeline.load_weights(pipeline.folder, strict=True)
        return pipeline

    def pipeline(self) -> list[dict[str, Any]]:
        return load_template("omnistage.models.diffusion", self.template)


def is_diffusion_family(family: ModelFamily) -> TypeIs[DiffusionFamily]:
    return isinstance(family, DiffusionFamily)
