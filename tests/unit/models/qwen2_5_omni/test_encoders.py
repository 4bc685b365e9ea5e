"""The thinker's audio and vision encoders, loaded from the tiny checkpoint through omnistage's
loader into an arena, against transformers' ``from_pretrained``: the same parameters, bit for
bit, and per item the embeddings transformers' thinker computes (``get_audio_features``,
``get_image_features``, ``get_video_features``), and for a whole prompt the ``inputs_embeds``
its forward merges (audio in video interleaved included), exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import load_into, module_targets
from omnistage.models.media import Audio, MediaItem, Video
from omnistage.models.qwen2_5_omni import FAMILY
from omnistage.models.tensor_parallel import shards_of
from tests.qwen2_5_omni_reference import load_model


@pytest.fixture(scope="module")
def folder(tiny_qwen2_5_omni_folder):
    return tiny_qwen2_5_omni_folder


def thinker(folder, dtype=torch.float32, device="cpu"):
    """The thinker decoder as a stage builds it: on meta, adopted into an arena, loaded
    through the family's rename (as ``ModelRunner`` does)."""
    config = ARModelConfig.from_pretrained(folder, model_stage="thinker")
    model = FAMILY.build_decoder(config, dtype)
    Arena(device).adopt(model)
    load_into(
        module_targets(model),
        folder,
        rename=FAMILY.rename("thinker"),
        strict=True,
        shards=shards_of(model) or None,
    )
    return model


@pytest.fixture(scope="module")
def ours(folder):
    return thinker(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return load_model(str(folder)).thinker.model


@pytest.fixture(scope="module")
def processor(folder):
    return FAMILY.prompt_processor(folder)


def noise(seconds: float, seed: int) -> np.ndarray:
    return (0.2 * np.random.RandomState(seed).randn(int(seconds * 16000))).astype(np.float32)


def pixels(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, shape, np.uint8)


def prompt(processor, *modalities: str) -> list[int]:
    ids = [100, 101]  # text (the special tokens are the first ids)
    for m in modalities:
        bos, eos = (
            (processor.audio_bos, processor.audio_eos)
            if m == "audio"
            else (processor.vision_bos, processor.vision_eos)
        )
        ids += [bos, processor.placeholder_ids[m], eos, 102]
    return ids


def mixed(processor, use_audio_in_video: bool):
    """A prompt with a 2.6 s audio (two encoder chunks), two images (one windowed over
    several merge windows) and a 2.5 s video of 5 frames whose audio track is interleaved
    or not."""
    media = [
        MediaItem("audio", Audio(noise(2.6, 0), 16000), "a"),
        MediaItem("image", Image.fromarray(pixels(150, 260, 3, seed=1)), "i1"),
        MediaItem("image", Image.fromarray(pixels(40, 70, 3, seed=2)), "i2"),
        MediaItem(
            "video", Video(pixels(5, 260, 350, 3, seed=3), 2.0, Audio(noise(2.5, 4), 16000)), "v"
        ),
    ]
    ids = prompt(processor, "audio", "image", "image", "video")
    return processor.process(ids, media, {"use_audio_in_video": use_audio_in_video})


def test_the_encoders_load_with_transformers_parameters(ours, hf):
    assert sorted(ours.encoders) == ["audio", "image", "video"]
    for ours_module, theirs in (
        (ours.encoders["audio"].audio_tower, hf.audio_tower),
        (ours.encoders["image"].visual, hf.visual),
    ):
        mine, ref = ours_module.state_dict(), theirs.state_dict()
        assert mine.keys() == ref.keys()
        for name, value in ref.items():
            assert torch.equal(mine[name], value), name
        for name, buf in ours_module.named_buffers():  # derived, computed: not on meta
            assert buf.device.type == "cpu" and torch.equal(buf, dict(theirs.named_buffers())[name])
    names = [n for n, _ in ours.named_parameters()]
    assert not any(n.startswith("encoders.video") for n in names)  # shared, registered once
    assert ours.encoders["video"]._shared == (ours.encoders["image"], ours.encoders["audio"])
    assert not any(n.startswith("encoders") for n in shards_of(ours))  # whole on every rank


def test_the_rename_reads_every_thinker_tensor(folder):
    from omnistage.models.loader import checkpoint_files, open_files

    rename = FAMILY.rename("thinker")
    with open_files(checkpoint_files(folder)) as files:
        keys = [k for f in files for k in f.keys()]  # noqa: SIM118
    thinker = [k for k in keys if k.startswith("thinker.")]
    assert all(rename(k) is not None for k in thinker)
    assert rename("thinker.audio_tower.conv1.weight") == "encoders.audio.audio_tower.conv1.weight"
    assert rename("thinker.visual.merger.mlp.0.bias") == "encoders.image.visual.merger.mlp.0.bias"
    assert rename("talker.model.norm.weight") is None


@torch.no_grad()
def test_each_item_encodes_as_transformers_features(ours, hf, processor):
    out = mixed(processor, use_audio_in_video=False)
    audio, image1, image2, video = out.items
    features = audio.data["input_features"]
    ref = hf.get_audio_features(
        features[None], torch.ones(1, features.shape[1], dtype=torch.long)
    ).last_hidden_state
    assert torch.equal(ours.encoders["audio"](**audio.data), ref)
    for item in (image1, image2):
        ref = hf.get_image_features(item.data["pixel_values"], item.data["image_grid_thw"])
        got = ours.encoders["image"](**item.data)
        assert got.shape == (item.length, 64)
        assert torch.equal(got, ref.pooler_output[0])
    ref = hf.get_video_features(video.data["pixel_values_videos"], video.data["video_grid_thw"])
    assert torch.equal(ours.encoders["video"](**video.data), ref.pooler_output[0])


def hf_inputs_embeds(hf, out, use_audio_in_video: bool):
    """The ``inputs_embeds`` and ``position_ids`` transformers' thinker forward hands its
    language model for the processed prompt (its inputs batched as its processor batches
    them: audio features padded with a mask, patches concatenated)."""
    items = {m: [i for i in out.items if i.modality == m] for m in ("audio", "image", "video")}
    audios = [i.data["input_features"] for i in out.items if "input_features" in i.data]
    longest = max(a.shape[1] for a in audios)
    features = torch.zeros(len(audios), audios[0].shape[0], longest)
    mask = torch.zeros(len(audios), longest, dtype=torch.long)
    for k, a in enumerate(audios):
        features[k, :, : a.shape[1]], mask[k, : a.shape[1]] = a, 1
    captured = {}

    def hook(_module, _args, kwargs):
        captured.update(embeds=kwargs["inputs_embeds"][0], positions=kwargs["position_ids"])

    handle = hf.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        hf.rope_deltas = None
        hf(
            input_ids=torch.tensor([out.token_ids]),
            attention_mask=torch.ones(1, len(out.token_ids), dtype=torch.long),
            input_features=features,
            feature_attention_mask=mask,
            pixel_values=torch.cat([i.data["pixel_values"] for i in items["image"]]),
            image_grid_thw=torch.cat([i.data["image_grid_thw"] for i in items["image"]]),
            pixel_values_videos=items["video"][0].data["pixel_values_videos"],
            video_grid_thw=items["video"][0].data["video_grid_thw"],
            video_second_per_grid=torch.tensor([1.0]),
            use_audio_in_video=use_audio_in_video,
        )
    finally:
        handle.remove()
    return captured["embeds"], captured["positions"]


@pytest.mark.parametrize("use_audio_in_video", [False, True])
@torch.no_grad()
def test_merged_embeddings_equal_transformers_forward(ours, hf, processor, use_audio_in_video):
    out = mixed(processor, use_audio_in_video)
    embeds = ours.embed(torch.tensor(out.token_ids)).clone()
    for item in out.items:
        embeds[item.offset : item.offset + item.length] = ours.encoders[item.modality](**item.data)
    ref, positions = hf_inputs_embeds(hf, out, use_audio_in_video)
    assert torch.equal(positions[:, 0], out.positions)
    assert torch.equal(embeds, ref)
    video = out.items[-1]
    if use_audio_in_video:  # one item, video and audio tokens interleaved in 2 s chunks
        flags = video.data["is_video"].tolist()
        assert 0 < sum(flags) < len(flags) and flags[0]
        assert flags != sorted(flags, reverse=True)  # several chunks
    else:
        assert "is_video" not in video.data


def test_bfloat16_encoders_run(folder, processor):
    model = thinker(folder, torch.bfloat16)
    out = mixed(processor, use_audio_in_video=True)
    assert model.encoders["audio"].audio_tower.conv1.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for item in out.items:
            got = model.encoders[item.modality](**item.data)
            assert got.shape == (item.length, 64) and got.dtype == torch.bfloat16
            assert torch.isfinite(got.float()).all()


@pytest.mark.parametrize(
    "modality, data, field",
    [
        ("audio", {"input_features": torch.zeros(80, 10)}, "input_features"),
        (
            "image",
            {"pixel_values": torch.zeros(5, 1176), "image_grid_thw": torch.tensor([[1, 2, 2]])},
            "pixel_values",
        ),
        (
            "image",
            {"pixel_values": torch.zeros(6, 1176), "image_grid_thw": torch.tensor([[1, 2, 3]])},
            "grid_thw",
        ),
        (
            "video",
            {
                "pixel_values_videos": torch.zeros(8, 1176),
                "video_grid_thw": torch.tensor([[2, 2, 2]]),
                "is_video": torch.ones(2, dtype=torch.bool),
            },
            "is_video",
        ),
    ],
)
def test_inconsistent_data_is_refused(ours, modality, data, field):
    with pytest.raises(InvalidRequestError) as err:
        ours.encoders[modality](**data)
    assert err.value.field == f"multi_modal.data.{field}"
