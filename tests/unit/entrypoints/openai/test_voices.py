"""The uploaded-voice store: kept across a restart, bounded, names without case, written
whole or not at all."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.openai.voices import Voice, VoiceStore
from omnistage.errors import InvalidRequestError


def _voice(name: str, **extra: object) -> Voice:
    fields = {"consent": "c-1", "created_at": 1, "file_size": 3, "mime_type": "audio/wav"}
    return Voice(name=name, **{**fields, **extra})  # type: ignore[arg-type]


def test_a_voice_survives_a_restart_with_its_clip_and_transcript(tmp_path) -> None:
    store = VoiceStore(tmp_path, max_voices=4, max_bytes=1024)
    store.add(_voice("Alice", ref_text="hello"), b"RIFF")
    again = VoiceStore(tmp_path, max_voices=4, max_bytes=1024)
    assert again.get("alice") == _voice("Alice", ref_text="hello")
    assert again.get("ALICE") is not None and again.audio("aLiCe") == b"RIFF"
    assert again.listed() == [{"name": "Alice", "consent": "c-1", "created_at": 1,
                               "file_size": 3, "mime_type": "audio/wav", "ref_text": "hello",
                               "embedding_source": "audio"}]  # fmt: skip


def test_an_embedding_voice_survives_a_restart_and_replaces_a_clip(tmp_path) -> None:
    from omnistage.entrypoints.openai.voices import _embedding_file

    store = VoiceStore(tmp_path, max_voices=4, max_bytes=1024)
    store.add(_voice("eve"), b"RIFF")
    data = _embedding_file([0.25, -1.5, 3.0])
    voice = _voice("Eve", file_size=len(data), mime_type="application/x-safetensors",
                   embedding_dim=3)  # fmt: skip
    store.add(voice, data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eve.json", "eve.safetensors"]
    again = VoiceStore(tmp_path, max_voices=4, max_bytes=1024)
    assert again.get("EVE") == voice and again.embedding("eve") == [0.25, -1.5, 3.0]
    (listed,) = again.listed()
    assert (listed["embedding_source"], listed["embedding_dim"]) == ("direct", 3)
    assert again.delete("eve") and list(tmp_path.iterdir()) == []


def test_the_store_is_bounded_and_a_same_name_upload_replaces(tmp_path) -> None:
    store = VoiceStore(tmp_path, max_voices=2, max_bytes=1024)
    store.add(_voice("a"), b"1")
    store.add(_voice("b"), b"2")
    store.add(_voice("A", consent="c-2"), b"3")  # replaces, so the store is not full
    assert len(store) == 2 and store.audio("a") == b"3"
    with pytest.raises(InvalidRequestError, match="at most 2 uploaded voices") as err:
        store.add(_voice("c"), b"4")
    assert err.value.field == "name"
    assert store.delete("B") and not store.delete("b")
    store.add(_voice("c"), b"4")
    assert sorted(v["name"] for v in store.listed()) == ["A", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.audio", "a.json", "c.audio", "c.json"]


def test_a_half_written_or_broken_voice_is_not_restored(tmp_path) -> None:
    store = VoiceStore(tmp_path, max_voices=4, max_bytes=1024)
    store.add(_voice("good"), b"1")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "broken.audio").write_bytes(b"x")
    (tmp_path / "orphan.json").write_text((tmp_path / "good.json").read_text())  # no clip
    (tmp_path / ".good.audio.123.tmp").write_bytes(b"partial")  # an upload cut short
    assert [v["name"] for v in VoiceStore(tmp_path, 4, 1024).listed()] == ["good"]
