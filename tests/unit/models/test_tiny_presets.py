import pytest

from omnistage.models.tiny import ensure_preset


def test_ensure_preset_refuses_to_replace_a_foreign_folder(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"precious")
    with pytest.raises(ValueError, match="not built by omnistage"):
        ensure_preset("demo", foreign)
    assert (foreign / "weights.bin").read_bytes() == b"precious"


def test_ensure_preset_builds_once(tmp_path):
    out = ensure_preset("demo", tmp_path / "demo")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_preset("demo", out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_build_by_older_builders_is_replaced(tmp_path):
    from omnistage.models import tiny

    out = tiny.ensure_preset("demo", tmp_path / "demo")
    (out / ".omnistage-built").write_text("demo\n")  # what builds before versions wrote
    (out / "left-over.txt").write_text("old")
    assert tiny.is_built(out) and not tiny.is_built(out, "demo")
    tiny.ensure_preset("demo", out)
    assert tiny.is_built(out, "demo")
    assert not (out / "left-over.txt").exists()
    assert not list(tmp_path.glob(".demo.*"))
