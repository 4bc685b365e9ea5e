"""Checkpoint names of Qwen3-Omni's decoder parts → the decoder's (each part reads only its own
tensors).

The thinker's (``thinker.*``): ``thinker.model.*`` is the text decoder under our decoder's
own names (``model.layers.N.mlp.experts.E.gate_proj.weight``: experts saved one by one, as
the published checkpoints hold them and transformers' ``save_pretrained`` writes them),
``thinker.lm_head.*`` its head, ``thinker.audio_tower.*`` and ``thinker.visual.*`` the
encoders (``omnistage.models.qwen3_omni.encoders``: ``encoders.audio.audio_tower.*``,
``encoders.image.visual.*``).
"""

from __future__ import annotations

from collections.abc import Callable

from omnistage.errors import CheckpointError

Rename = Callable[[str], str | None]

THINKER_PREFIXES = {
    "model.": "model.",
    "lm_head.": "lm_head.",
    "audio_tower.": "encoders.audio.audio_tower.",
    "visual.": "encoders.image.visual.",
}


def prefix_rename(part: str, prefixes: dict[str, str], skipped: str) -> Rename:
    """``part``'s rename: ``part.<src>...`` → ``<dst>...`` for the first of ``prefixes``
    (``src`` → ``dst``) that matches; None for other parts' names, names ending in ``skipped``
    (derived buffers) and names no prefix matches."""
    head = f"{part}."

    def rename(name: str) -> str | None:
        if not name.startswith(head) or name.endswith(skipped):
            return None
        rest = name[len(head) :]
        for src, dst in prefixes.items():
            if rest.startswith(src):
                return dst + rest[len(src) :]
        return None

    return rename


# A checkpoint name → the thinker decoder module's name (None: not the thinker's).
thinker_rename = prefix_rename("thinker", THINKER_PREFIXES, "rotary_emb.inv_freq")


PART_RENAMES: dict[str, Rename] = {"thinker": thinker_rename}


def decoder_rename(part: str) -> Rename:
    """The rename of decoder part ``part``."""
    rename = PART_RENAMES.get(part)
    if rename is None:
        raise CheckpointError(
            f"model_stage: a Qwen3-Omni checkpoint's decoder parts are {sorted(PART_RENAMES)}, "
            f"got {part!r}"
        )
    return rename
