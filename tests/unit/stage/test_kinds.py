"""The kinds map is the one list of stage kinds: the wire unions come from it, and pipelines
are checked against it before any stage starts."""

from __future__ import annotations

import typing

import pytest

from omnistage.config import ConfigError
from omnistage.pipelines import apply_overrides, parse_pipeline
from omnistage.stage import messages
from omnistage.stage.kinds import STAGE_KINDS, stage_kind


def test_each_kinds_wire_structs_are_tagged_with_its_name_and_in_the_unions():
    requests = typing.get_args(messages.StageRequest)
    infos = typing.get_args(messages.StageInfo)
    for name, spec in STAGE_KINDS.items():
        assert spec.request_type.__struct_config__.tag == name
        assert spec.info_type.__struct_config__.tag == name
        assert spec.request_type in requests and spec.info_type in infos
        if spec.output_type is not None:  # a struct, or a union of them (images or videos)
            outputs = typing.get_args(spec.output_type) or (spec.output_type,)
            assert set(outputs) <= set(typing.get_args(messages.MediaOutput))


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"known kinds: \['ar', 'code2wav', 'diffusion'\]"):
        stage_kind("gan")


def test_tensor_parallelism_reaches_only_kinds_that_split():
    assert apply_overrides({"kind": "diffusion"}, {"tensor_parallel_size": 2}) == {
        "kind": "diffusion"
    }
    assert apply_overrides({"kind": "ar"}, {"tensor_parallel_size": 2})["tensor_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"stages\.0\.tensor_parallel_size"):
        parse_pipeline(
            {
                "stages": [
                    {"stage_id": 0, "kind": "code2wav", "model": "m", "tensor_parallel_size": 2}
                ]
            },
            "test",
        )


def test_every_kind_has_its_options_section_in_the_stage_config():
    from omnistage.config import KIND_OPTIONS, StageConfig

    assert set(KIND_OPTIONS) == set(STAGE_KINDS)
    for kind, options in KIND_OPTIONS.items():
        assert StageConfig.model_fields[kind].annotation is options, kind
