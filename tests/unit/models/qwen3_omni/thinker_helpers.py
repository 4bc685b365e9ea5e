"""What the thinker tests share: the tiny Qwen3-Omni checkpoint (built once per clone into the
test cache), the thinker decoder and encoders as a stage builds and loads them, transformers'
thinker and processor, a few prompts and a greedy loop over our decoder."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from omnistage.memory import Arena
from omnistage.models.family import build_decoder
from omnistage.models.loader import load_into, module_targets
from omnistage.models.media import Audio, MediaItem, ProcessedPrompt
from omnistage.models.qwen3_omni.config import read_config, thinker_config
from omnistage.models.qwen3_omni.encoders import thinker_encoders
from omnistage.models.qwen3_omni.weights import decoder_rename
from omnistage.models.tensor_parallel import SINGLE, TPGroup, shards_of

PRESET = "tiny-qwen3-omni"


@functools.cache
def tiny_folder() -> Path:
    """The ``tiny-qwen3-omni`` preset, built once per clone into the test cache."""
    from omnistage.models.tiny import ensure_preset

    return ensure_preset(PRESET, Path(os.environ["OMNISTAGE_CACHE_DIR"]) / PRESET)


def our_thinker(folder: Path, dtype: torch.dtype = torch.float32, tp: TPGroup = SINGLE):
    """The thinker decoder with its encoders, on meta, adopted into an arena, loaded through
    the part's rename (a tensor-parallel rank: its slices)."""
    config = thinker_config(read_config(folder) or {})
    model = build_decoder(config, dtype, tp)
    model.encoders.update(thinker_encoders(config.extras, dtype))
    Arena("cpu").adopt(model)
    load_into(
        module_targets(model),
        folder,
        rename=decoder_rename("thinker"),
        strict=True,
        shards=shards_of(model) or None,
    )
    return model


def hf_thinker(folder: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval().thinker


def hf_processor(folder: Path):
    """transformers' processor (PIL images, the stand-in video processor:
    tests/qwen3_omni_media.py)."""
    from tests.qwen3_omni_media import hf_processor as processor

    return processor(str(folder))


def noise(samples: int, seed: int) -> np.ndarray:
    return (0.2 * np.random.RandomState(seed).randn(samples)).astype(np.float32)


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(
        np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8)
    )


# Media per prompt: the audio spans two encoder chunks (2.6 s: 260 frames), the second is
# over 3 s; the first picture covers several merge windows, the second is small.
CASES: dict[str, list[tuple[str, object]]] = {
    "text": [],
    "audio": [("audio", noise(41650, 0))],
    "image": [("image", picture(150, 260, 1))],
    "mixed": [
        ("audio", noise(41650, 0)),
        ("image", picture(150, 260, 1)),
        ("audio", noise(52800, 2)),
        ("image", picture(40, 70, 3)),
    ],
}


def messages_of(case: str) -> list[dict]:
    content = [{"type": kind, kind: value} for kind, value in CASES[case]]
    content.append({"type": "text", "text": "What is this?"})
    return [{"role": "user", "content": content}]


def media_of(case: str) -> list[MediaItem]:
    return [
        MediaItem(kind, Audio(value, 16000) if kind == "audio" else value, f"{case}{k}")  # type: ignore[arg-type]
        for k, (kind, value) in enumerate(CASES[case])
    ]


def hf_inputs(hf_proc, case: str) -> dict:
    """transformers' processor output for ``case``'s chat."""
    text = hf_proc.tokenizer.apply_chat_template(
        messages_of(case), tokenize=False, add_generation_prompt=True
    )
    call: dict = {"return_tensors": "pt"}
    audio = [v for kind, v in CASES[case] if kind == "audio"]
    images = [v for kind, v in CASES[case] if kind == "image"]
    if audio:
        call["audio"] = audio
    if images:
        call["images"] = images
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(hf_proc(text=text, **call))


def prompt_inputs(model, prompt: ProcessedPrompt) -> tuple[torch.Tensor, tuple | None]:
    """The prompt's input embeddings (encoder outputs at their placeholders) and the rows
    added after the first layers, as the model runner's encoder step makes them."""
    embeds = model.embed(torch.tensor(prompt.token_ids)).clone()
    added = []
    for item in prompt.items:
        encoded = model.encoders[item.modality](**item.data)
        if encoded.dim() == 3:
            added.append((item.offset, encoded[1:]))
            encoded = encoded[0]
        embeds[item.offset : item.offset + item.length] = encoded
    if not added:
        return embeds, None
    at = torch.cat([torch.arange(first, first + rows.shape[1]) for first, rows in added])
    return embeds, (at, torch.cat([rows for _, rows in added], dim=1))


@torch.no_grad()
def greedy(model, prompt: ProcessedPrompt, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy ids of our decoder (each step over the whole sequence, no cache) and
    the prompt's last logits."""
    embeds, layer_rows = prompt_inputs(model, prompt)
    n = len(prompt.token_ids)
    assert prompt.positions is not None
    ids: list[int] = []
    first = None
    for _ in range(steps):
        later = torch.arange(n, n + len(ids)) + prompt.position_delta
        positions = torch.cat([prompt.positions, later.expand(3, -1)], dim=1)
        x = torch.cat([embeds, model.embed(torch.tensor(ids, dtype=torch.long))])
        hidden = model(None, positions, inputs_embeds=x, layer_rows=layer_rows)
        logits = model.compute_logits(hidden[-1:])[0]
        first = logits if first is None else first
        ids.append(int(logits.argmax()))
    assert first is not None
    return ids, first


@torch.no_grad()
def prompt_logits(model, prompts: list[ProcessedPrompt]) -> list[torch.Tensor]:
    """Every prompt position's logits, each prompt a prefill of its own."""
    out = []
    for prompt in prompts:
        embeds, rows = prompt_inputs(model, prompt)
        hidden = model(None, prompt.positions, inputs_embeds=embeds, layer_rows=rows)
        out.append(model.compute_logits(hidden))
    return out


def tp_rank_main(folder: str, prompts: list, store: str, rank: int, queue) -> None:
    """One of two tensor-parallel ranks (a spawned process): its prompts' logits, as arrays
    (a tensor on a queue is a handle to shared memory that dies with the rank)."""
    from omnistage.models.tensor_parallel import join_group

    torch.set_num_threads(1)
    try:
        tp = join_group(store, rank, 2, torch.device("cpu"))
        logits = prompt_logits(our_thinker(Path(folder), tp=tp), prompts)
        queue.put((rank, [t.numpy() for t in logits]))
    except BaseException as exc:  # reported to the test
        queue.put((rank, repr(exc)))


def tp2_logits(folder: Path, prompts: list[ProcessedPrompt]) -> list[torch.Tensor]:
    """The prompts' logits on two gloo ranks (both must end with the same, gathered)."""
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="omnistage-tp-test-")
    procs = [
        ctx.Process(target=tp_rank_main, args=(str(folder), prompts, store, r, queue))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, got in results.items():
        assert not isinstance(got, str), f"rank {rank}: {got}"
    for a, b in zip(results[0], results[1], strict=True):
        assert np.array_equal(a, b)
    return [torch.from_numpy(a) for a in results[0]]
