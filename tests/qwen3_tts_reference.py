"""The Qwen3-TTS reference: the official ``qwen-tts`` package (``qwen-tts-hf``, its build for
transformers 5), loaded for tests only.

Its import pulls in modules that have no build for this machine's torch or that the 12 Hz
paths never call: the 25 Hz tokenizer's ``torchaudio``, ``sox``, ``onnxruntime`` and
``einops``, and ``librosa``, of which only ``filters.mel`` runs (a cloned voice's speaker
embedding). Those are stubbed here: a call to any stub but ``librosa.filters.mel`` raises, and
``librosa.filters.mel`` is librosa's own formula (Slaney mel scale and norm, as the reference
calls it), transcribed. Three places where the package breaks on transformers 5.25 are
restored to what it meant: its rope registry entry ``default`` reads ``config.rope_theta``,
which transformers' Mimi config no longer has (it falls back to ``rope_parameters``); its Mimi
encoder subclass assigns attributes that are now read-only properties (it is built as
``MimiModel`` is, with no decoder); and ``generate`` now hands a model its KV cache as
``cache``, which the talker's and the code predictor's ``forward`` (taking ``past_key_values``)
dropped into ``**kwargs`` — every decode step then saw only its own token (it is passed on as
``past_key_values``). Its ``save_pretrained`` fails too (``_tied_weights_keys`` a list where
transformers wants a dict): tests write its state dict with safetensors.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from functools import cache
from typing import Any

import numpy as np


def _never(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is a stub in this test harness (never called on 12 Hz paths)")

    return call


def _hz_to_mel(freqs: Any) -> Any:  # librosa.hz_to_mel, htk=False (Slaney)
    freqs = np.asanyarray(freqs, dtype=float)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    mels = freqs / f_sp
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    if freqs.ndim:
        log_t = freqs >= min_log_hz
        mels[log_t] = min_log_mel + np.log(freqs[log_t] / min_log_hz) / logstep
    elif freqs >= min_log_hz:
        mels = min_log_mel + np.log(freqs / min_log_hz) / logstep
    return mels


def _mel_to_hz(mels: Any) -> Any:  # librosa.mel_to_hz, htk=False
    mels = np.asanyarray(mels, dtype=float)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    freqs = f_sp * mels
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    log_t = mels >= min_log_mel
    freqs[log_t] = min_log_hz * np.exp(logstep * (mels[log_t] - min_log_mel))
    return freqs


def librosa_mel(
    *,
    sr: float,
    n_fft: int,
    n_mels: int = 128,
    fmin: float = 0.0,
    fmax: float | None = None,
    htk: bool = False,
    norm: str = "slaney",
    dtype: Any = np.float32,
) -> Any:
    """``librosa.filters.mel`` (0.10) for ``htk=False, norm='slaney'``, the reference's call."""
    if htk or norm != "slaney":
        raise NotImplementedError("only librosa's defaults (Slaney) are transcribed")
    fmax = float(sr) / 2 if fmax is None else fmax
    weights = np.zeros((n_mels, int(1 + n_fft // 2)), dtype=dtype)
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, np.newaxis]
    return weights


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _stub_missing_modules() -> None:
    """Stubs for what the package imports and this machine lacks (only where it lacks them:
    a real module is never replaced)."""
    import importlib.util

    # transformers caches whether these exist: ask before the stubs make them seem to
    from transformers.utils import import_utils

    import_utils.is_librosa_available()
    import_utils.is_torchaudio_available()
    filters = _module("librosa.filters", mel=librosa_mel)
    kaldi = _module("torchaudio.compliance.kaldi", fbank=_never("torchaudio...kaldi.fbank"))
    compliance = _module("torchaudio.compliance", kaldi=kaldi)
    stubs = {
        "librosa": _module(
            "librosa",
            filters=filters,
            load=_never("librosa.load"),
            resample=_never("librosa.resample"),
        ),
        "librosa.filters": filters,
        "einops": _module(
            "einops", rearrange=_never("einops.rearrange"), repeat=_never("einops.repeat")
        ),
        "sox": _module("sox"),
        "onnxruntime": _module("onnxruntime"),
        "torchaudio": _module("torchaudio", compliance=compliance),
        "torchaudio.compliance": compliance,
        "torchaudio.compliance.kaldi": kaldi,
    }
    missing = {top for top in ("librosa", "einops", "sox", "onnxruntime", "torchaudio")
               if top not in sys.modules and importlib.util.find_spec(top) is None}  # fmt: skip
    sys.modules.update({n: m for n, m in stubs.items() if n.split(".")[0] in missing})


def _restore_for_transformers_5_25() -> None:
    """The package's two breaks on transformers 5.25, restored to what it meant."""
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as v2
    from transformers import MimiModel
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    package_default = ROPE_INIT_FUNCTIONS["default"]

    def default_rope(config: Any, device: Any = None, seq_len: Any = None, layer_type: Any = None):
        if getattr(config, "rope_theta", None) is not None:
            return package_default(config, device)
        import torch

        params = config.rope_parameters
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        steps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
        return 1.0 / (params["rope_theta"] ** (steps / dim)), 1.0

    ROPE_INIT_FUNCTIONS["default"] = default_rope

    def encoder_init(self: Any, config: Any) -> None:
        MimiModel.__init__(self, config)
        self.config = config
        self.decoder = None

    v2.Qwen3TTSTokenizerV2Encoder.__init__ = encoder_init

    from qwen_tts.core.models import modeling_qwen3_tts as tts

    for cls in (
        tts.Qwen3TTSTalkerForConditionalGeneration,
        tts.Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
    ):
        cls.forward = _taking_cache(cls.forward)


def _taking_cache(forward: Any) -> Any:
    """``forward`` given its KV cache as ``cache`` (transformers 5.25) or ``past_key_values``."""
    import functools

    @functools.wraps(forward)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "cache" in kwargs and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = kwargs.pop("cache")
        return forward(self, *args, **kwargs)

    return call


@cache
def qwen_tts() -> types.ModuleType:
    """The ``qwen_tts`` package, importable here (see the module's docstring)."""
    import transformers  # noqa: F401 - first: its availability checks see the real modules

    _stub_missing_modules()
    import qwen_tts as package

    _restore_for_transformers_5_25()
    return package
