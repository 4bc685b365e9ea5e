"""The documents users follow stay true: the README's pipeline example is the example file,
which names every stage field and loads; the README's built-in pipelines are the ones
`omnistage serve --help` lists, and those that exist; links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from omnistage.config import KIND_OPTIONS, StageConfig, load_pipeline_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipeline.yaml"
README = ROOT / "README.md"


def test_the_readme_shows_the_example_pipeline_verbatim():
    assert EXAMPLE.read_text() in (ROOT / "README.md").read_text()


def test_the_example_pipeline_names_every_stage_field_and_loads():
    text = EXAMPLE.read_text()
    keys = set(re.findall(r"^\s*(?:- |# )?([a-z0-9_]+):", text, flags=re.M))
    fields = set(StageConfig.model_fields).union(
        *(options.model_fields for options in KIND_OPTIONS.values())
    )
    missing = sorted(fields - keys)
    assert not missing, missing
    config = load_pipeline_config(EXAMPLE)
    assert [s.kind for s in config.stages] == ["ar", "diffusion"]
    assert config.stages[0].ar.kv_cache_memory == 32 << 20  # each kind's options, nested
    assert config.stages[1].diffusion.max_batch_size == 4


def test_readme_make_serve_settings_exist_in_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    for name in ("HOST", "PORT", "PIPELINE"):
        assert re.search(rf"^{name} \?=", makefile, flags=re.M), name
        assert f"{name}=" in (ROOT / "README.md").read_text()


def test_the_readme_and_serve_help_list_the_built_in_pipelines():
    from omnistage.entrypoints.openai.server_config import ServerConfig
    from omnistage.pipelines import builtin_pipelines

    described = ServerConfig.model_fields["pipeline"].description or ""
    listed = described.split("): ", 1)[1].removesuffix(".").split(", ")
    assert sorted(listed) == builtin_pipelines()
    block = re.search(r"built-in pipelines: (.*?)\nomnistage/bench", README.read_text(), re.S)
    assert block is not None
    names = " ".join(block.group(1).split()).replace(" (default)", "").split(", ")
    assert sorted(names) == builtin_pipelines(), "README's Layout: list every built-in pipeline"


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken


def test_the_qwen2_5_omni_guide_pipeline_is_valid():
    import yaml

    from omnistage.config import parse_pipeline_config

    text = (ROOT / "docs" / "qwen-omni.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    config = parse_pipeline_config(yaml.safe_load(block), "docs/qwen-omni.md")
    assert [s.model_stage for s in config.stages] == ["thinker", "talker", "code2wav"]
    assert config.stages[1].ar.kv_cache_memory == 4 << 30
    assert config.stages[2].code2wav.max_num_seqs == 4


def test_the_two_node_example_is_a_valid_pipeline():
    import re

    import yaml

    from omnistage.config import parse_pipeline_config

    text = (ROOT / "docs" / "distributed.md").read_text()
    block = re.search(r"`two-nodes.yaml`:\n\n```yaml\n(.*?)```", text, re.S)
    assert block is not None
    config = parse_pipeline_config(yaml.safe_load(block.group(1)), "docs/distributed.md")
    thinker, decoder = config.stages
    assert thinker.placement is not None and decoder.placement is not None
    assert thinker.placement.resources == {"node_a": 1}
    assert decoder.placement.resources == {"node_b": 1}


def test_the_family_tables_are_the_registrys():
    """docs/adding-a-model.md's table and design.md's map name every family the registry
    knows, with what its checkpoints say and its home (they once omitted Qwen3-Omni)."""
    from omnistage.models.registry import FAMILIES

    table = (ROOT / "docs" / "adding-a-model.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `([a-z0-9_]+)` \|.*$", table, flags=re.M)}
    assert set(rows) == {f.name for f in FAMILIES}, sorted(rows)
    design = (ROOT / "docs" / "design.md").read_text()
    for family in FAMILIES:
        row = rows[family.name]
        for said in (*family.architectures, *family.model_types, *family.pipeline_classes):
            assert f"`{said}`" in row, (family.name, said)
        home = family.home.removeprefix("omnistage.").replace(".", "/")
        assert f"`{home}" in row, (family.name, home)
        assert home.rsplit("/", 1)[-1] in design, (family.name, "design.md")


def test_every_shell_and_python_example_says_how_it_runs():
    """Each ``bash``/``python`` block of the README and docs/ follows a marker: the built-in
    pipeline it runs against (tests/e2e/test_docs_examples.py runs it), or why it is not run
    here (tests/docs_examples.py)."""
    from omnistage.pipelines import builtin_pipelines
    from tests.docs_examples import examples

    found = examples()
    assert len(found) > 30
    unmarked = [e.where for e in found if e.marker is None]
    assert not unmarked, f"say how these run (<!-- example: ... -->): {unmarked}"
    for example in found:
        if not example.runs:
            assert example.marker.removeprefix("not run:").strip(), example.where
            continue
        assert example.pipeline in builtin_pipelines(), example.where
        assert example.expected is None or all(100 <= s <= 599 for s in example.expected), (
            example.where
        )
    assert sum(e.runs for e in found) >= 20
