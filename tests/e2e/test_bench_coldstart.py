"""``omnistage bench coldstart`` for real on tiny-chat: an AR stage imports only what it needs
(no transformers, diffusers, sympy — torch._dynamo's —, web or template packages), and the
pipeline's spawn-to-first-token and ``omnistage serve``-to-ready figures come out."""

import json

from omnistage.bench import coldstart


def test_an_ar_stage_imports_only_what_it_needs_and_the_figures_are_written(tmp_path):
    table = coldstart.run(str(tmp_path), pipelines=("tiny-chat",), repeats=1)
    (row,) = json.loads((tmp_path / "coldstart-cpu.json").read_text())["rows"]
    assert row["kind"] == "ar" and row["heavy"] == "-", row["top_packages"]
    assert "torch" in row["top_packages"]
    assert row["import_ms"] > row["torch_ms"] > 0 and row["build_ms"] > 0
    assert row["serve_first_token_ms"] >= row["serve_ready_ms"] > 0
    # Measured in other processes than the breakdown (which runs under -X importtime): the
    # first token includes torch's import and the engine build, whatever else varies.
    assert row["first_token_ms"] > row["torch_ms"] + row["build_ms"]
    assert "| tiny-chat |" in table
