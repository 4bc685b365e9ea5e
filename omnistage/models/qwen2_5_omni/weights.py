"""Checkpoint names of Qwen2.5-Omni's decoder parts → the decoder's (``thinker.*`` and
``talker.*``; each part reads only its own tensors). The thinker's encoders live in the
decoder's ``encoders`` (``omnistage.models.qwen2_5_omni.encoders``)."""

from __future__ import annotations

from collections.abc import Callable


def decoder_rename(part: str) -> Callable[[str], str | None]:
    """Checkpoint name → the decoder module's name, for ``part``'s tensors only."""
    prefix = f"{part}."
    heads = {"thinker": {"lm_head.": "lm_head."}, "talker": {"codec_head.": "lm_head."}}[part]
    extra = {
        "thinker": {
            "audio_tower.": "encoders.audio.audio_tower.",
            "visual.": "encoders.image.visual.",
        },
        "talker": {"thinker_to_talker_proj.": "input_proj."},
    }[part]

    def rename(name: str) -> str | None:
        if not name.startswith(prefix) or name.endswith("rotary_emb.inv_freq"):
            return None
        rest = name[len(prefix) :]
        if rest.startswith("model."):
            return rest
        for table in (heads, extra):
            for src, dst in table.items():
                if rest.startswith(src):
                    return dst + rest[len(src) :]
        return None

    return rename
