"""The token2wav loop, one ODE step at a time, written to match transformers' Qwen2.5-Omni.

A ``Token2WavSynthesis`` is one utterance (utterances are never batched together: their
lengths differ, and transformers decodes each sample alone too). ``advance()`` is one step of
``RungeKutta4ODESolver`` — four DiT calls, each with classifier-free guidance run as
``Qwen2_5OmniToken2WavDiTModel.sample`` runs it — so the code2wav stage can interleave the
steps of several utterances and check for aborts between them. ``waveform()`` runs the
BigVGAN on the final mel.

Per request, as ``Qwen2_5OmniToken2WavModel.forward`` after ``torch.manual_seed(seed)``:
noise ``[1, len(codes) * repeats, mel_dim]`` from a CPU generator seeded with the seed (the
same draw as the global CPU generator), the voice's ``cond`` repeated along time as the
speaker embedding, its ``ref_mel`` as the reference, time points ``linspace(0, 1, num_steps)``
swayed by ``sway_coefficient``. The arithmetic is transformers', term by term, so the
waveform equals its output; a job's result never depends on the jobs beside it, also when
its steps share DiT forwards with theirs (``advance_together``, ``dit_batch``).
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.models.qwen2_5_omni.dit_batch import DiTRows, guided_velocity

# RungeKutta4ODESolver's constants (Python floats, as there)
ONE_THIRD = 1 / 3
TWO_THIRDS = 2 / 3
NO_GUIDANCE_BELOW = 1e-5  # sample(): guidance_scale < 1e-5 runs the DiT once, unguided


def time_points(num_steps: int, sway_coefficient: float, device: torch.device) -> torch.Tensor:
    """``sample()``'s time grid: ``linspace(0, 1, num_steps)`` plus the sway term."""
    t = torch.linspace(0, 1, num_steps, device=device, dtype=torch.float32)
    t += sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def _interpolate(
    t0: torch.Tensor, t1: torch.Tensor, y0: torch.Tensor, y1: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """``RungeKutta4ODESolver._linear_interpolation``."""
    if t == t0:
        return y0
    if t == t1:
        return y1
    weight = (t - t0) / (t1 - t0)
    return y0 + weight * (y1 - y0)


class Token2WavSynthesis:
    """One utterance's ODE solve, one RK4 step per ``advance``, then its waveform.
    ``pipeline`` is the loaded ``token2wav.Token2WavPipeline``; ``params`` carries ``voice`` (None: the default), ``num_steps``, ``guidance_scale`` and
    ``sway_coefficient``."""

    @torch.inference_mode()
    def __init__(
        self,
        pipeline: Any,
        codes: list[int],
        params: Any,
        seed: int,
        noise: torch.Tensor | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.guidance_scale = float(params.guidance_scale)
        device = pipeline.device
        self.voice = params.voice or pipeline.default_voice
        voice = pipeline.voices[self.voice]
        frames = len(codes) * pipeline.repeats
        self.codes = torch.tensor([codes], dtype=torch.long, device=device)
        # sample(): ``conditioning_vector.unsqueeze(1).repeat(1, maximum_duration, 1)``
        self.speaker = voice.cond.unsqueeze(1).repeat(1, frames, 1)
        self.ref_mel = voice.ref_mel
        if noise is None:  # a window of a streamed utterance brings its slice of the draw
            noise = torch.randn(
                [1, frames, pipeline.mel_dim],
                generator=torch.Generator("cpu").manual_seed(seed),
                dtype=torch.float32,
            )
        self.value = noise.to(device)
        self.times = time_points(params.num_steps, params.sway_coefficient, device)
        self.step_index = 0  # RK4 steps done
        # integrate(): the solution entry to fill next; the last entry is the result
        self._solution_index = 1
        self._result: torch.Tensor | None = None
        self._rows: DiTRows | None = None

    @property
    def is_done(self) -> bool:
        return self.step_index >= len(self.times) - 1

    def _velocity(self, t: torch.Tensor, y: torch.Tensor) -> Any:
        """``sample()``'s ``ode_function``."""
        dit, guidance = self.pipeline.dit, self.guidance_scale
        inputs = {
            "hidden_states": y,
            "speaker_embedding": self.speaker,
            "condition_vector": self.ref_mel,
            "quantized_code": self.codes,
            "time_step": t,
        }
        if guidance < NO_GUIDANCE_BELOW:
            return dit(**inputs, drop_audio_conditioning=False, drop_code=False, apply_cfg=False)
        output = dit(**inputs, apply_cfg=True)
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance

    @property
    def batch_key(self) -> tuple[int, int] | None:
        """Syntheses with equal keys can take their steps together (``advance_together``):
        guided ones of as many frames. None: alone (unguided)."""
        if self.guidance_scale < NO_GUIDANCE_BELOW:
            return None
        return int(self.value.shape[1]), int(self.value.shape[2])

    def rows(self) -> DiTRows:
        if self._rows is None:
            self._rows = DiTRows.of(
                self.pipeline.dit, self.codes, self.speaker, self.ref_mel, self.guidance_scale
            )
        return self._rows

    def stage_point(self, stage: int, ks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Where RK4's ``stage``-th velocity (0-3) of the next step is taken, given the ones
        before (``RungeKutta4ODESolver._rk4_step``'s terms)."""
        times, i, y = self.times, self.step_index, self.value
        t0, t1 = times[i], times[i + 1]
        dt = t1 - t0
        if stage == 0:
            return t0, y
        if stage == 1:
            return t0 + dt * ONE_THIRD, y + dt * ks[0] * ONE_THIRD
        if stage == 2:
            return t0 + dt * TWO_THIRDS, y + dt * (ks[1] - ks[0] * ONE_THIRD)
        return t1, y + dt * (ks[0] - ks[1] + ks[2])

    def complete_step(self, ks: list[torch.Tensor]) -> None:
        """The step from its four velocities (``RungeKutta4ODESolver.integrate``)."""
        times, i = self.times, self.step_index
        t0, t1 = times[i], times[i + 1]
        dt = t1 - t0
        y = self.value
        k1, k2, k3, k4 = ks
        y_next = y + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        last = len(times) - 1
        while self._solution_index <= last and t1 >= times[self._solution_index]:
            if self._solution_index == last:
                self._result = _interpolate(t0, t1, y, y_next, times[last])
            self._solution_index += 1
        self.value = y_next
        self.step_index += 1

    @torch.inference_mode()
    def advance(self) -> None:
        """One step of ``RungeKutta4ODESolver.integrate``."""
        ks: list[torch.Tensor] = []
        for stage in range(4):
            ks.append(self._velocity(*self.stage_point(stage, ks)))
        self.complete_step(ks)

    def current(self) -> Token2WavSynthesis:
        return self

    def settle(self) -> None:
        pass

    def mel(self) -> torch.Tensor:
        """The final mel ``[1, frames, mel_dim]``: the solver's last solution entry; where a
        time grid that is not increasing (a large ``sway_coefficient``) leaves that entry
        unset — transformers then returns uninitialised memory — the last step's value."""
        return self._result if self._result is not None else self.value

    @torch.inference_mode()
    def waveform(self) -> torch.Tensor:
        """The BigVGAN on the final mel (it clamps to [-1, 1] and returns the samples on the
        CPU), flattened to 1-D float32."""
        return self.pipeline.vocoder(self.mel().permute(0, 2, 1)).reshape(-1).float()


@torch.inference_mode()
def advance_together(items: list[Any]) -> None:
    """One step of each of ``items`` (``Token2WavSynthesis`` or a stream, whose ``current()``
    synthesis steps and which ``settle()`` afterwards): those with the same ``batch_key``
    share each DiT forward (``dit_batch``, which also runs the speaker encoder once per
    utterance instead of in every call), each getting the values it gets alone."""
    syntheses = [item.current() for item in items]
    groups: dict[Any, list[Token2WavSynthesis]] = {}
    for synthesis in syntheses:
        key = synthesis.batch_key
        groups.setdefault(key if key is not None else id(synthesis), []).append(synthesis)
    for group in groups.values():
        if group[0].batch_key is None:  # unguided: transformers' forward, one at a time
            for synthesis in group:
                synthesis.advance()
            continue
        ks: list[list[torch.Tensor]] = [[] for _ in group]
        dit = group[0].pipeline.dit
        for stage in range(4):
            points = [s.stage_point(stage, k) for s, k in zip(group, ks, strict=True)]
            velocities = guided_velocity(
                dit, [s.rows() for s in group], [t for t, _ in points], [y for _, y in points]
            )
            for k, v in zip(ks, velocities, strict=True):
                k.append(v)
        for synthesis, k in zip(group, ks, strict=True):
            synthesis.complete_step(k)
    for item in items:
        item.settle()


def synthesize(pipeline: Any, codes: list[int], params: Any, seed: int) -> torch.Tensor:
    """One utterance's waveform, all steps at once."""
    synthesis = Token2WavSynthesis(pipeline, codes, params, seed)
    while not synthesis.is_done:
        synthesis.advance()
    return synthesis.waveform()
