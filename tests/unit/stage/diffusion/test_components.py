"""Reading diffusers folders: malformed files raise ``CheckpointError``; the meta patch is undone."""

import threading

import pytest
from torch import nn

from omnistage.models.diffusion.components import (
    component_weight_files,
    parameters_on_meta,
    read_model_index,
)
from omnistage.models.loader import CheckpointError


@pytest.mark.parametrize("text", ["[1, 2]", '"transformer"', "not json"])
def test_a_model_index_that_is_not_an_object_is_a_checkpoint_error(tmp_path, text):
    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model_index.json"):
        read_model_index(tmp_path)


@pytest.mark.parametrize(
    "text", ["{", '{"metadata": {}}', '{"weight_map": [1]}', '{"weight_map": {"w": 1}}']
)
def test_a_broken_shard_index_is_a_checkpoint_error(tmp_path, text):
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="index.json"):
        component_weight_files(tmp_path)


def test_overlapping_builds_on_two_threads_restore_register_parameter():
    original = nn.Module.register_parameter
    first_inside, second_inside, first_left = (threading.Event() for _ in range(3))

    def first() -> None:
        with parameters_on_meta():
            first_inside.set()
            second_inside.wait(timeout=0.5)  # may not come: the second build waits its turn
        first_left.set()

    def second() -> None:
        first_inside.wait()
        with parameters_on_meta():
            second_inside.set()
            first_left.wait(timeout=5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    leaked = nn.Module.register_parameter is not original
    nn.Module.register_parameter = original  # type: ignore[method-assign]
    assert not leaked


def test_modules_built_on_other_threads_meanwhile_keep_real_parameters():
    inside, done = threading.Event(), threading.Event()

    def build() -> None:
        with parameters_on_meta():
            assert nn.Linear(2, 2).weight.is_meta
            inside.set()
            done.wait(timeout=5)

    thread = threading.Thread(target=build)
    thread.start()
    inside.wait()
    try:
        linear = nn.Linear(2, 2)
    finally:
        done.set()
        thread.join()
    assert not linear.weight.is_meta
