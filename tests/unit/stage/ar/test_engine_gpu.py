"""CUDA-only: decode graphs are captured once and replayed after sleep and wake."""

import pytest
import torch

from omnistage.stage.ar.sequence import ARRequest
from tests.unit.stage.ar.helpers import build_micro, generate, greedy, make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def batch(tag: str) -> list[ARRequest]:
    return [ARRequest(f"{tag}{i}", [5 + i, 9, 13 + 2 * i], greedy(16)) for i in range(5)]


def ids(results: dict, tag: str) -> list[list[int]]:
    return [results[f"{tag}{i}"].token_ids for i in range(5)]


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return build_micro(tmp_path_factory.mktemp("micro"))


def test_graph_decode_matches_eager_decode(micro):
    engine = make_engine(micro, device="cuda", max_num_seqs=8)
    assert engine.status()["cuda_graphs"]
    with_graphs = ids(generate(engine, batch("g")), "g")
    engine.worker.runner.decode_graphs = None
    assert ids(generate(engine, batch("e")), "e") == with_graphs
    engine.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_graphs_are_recalled_after_wake(micro, level):
    engine = make_engine(micro, device="cuda", max_num_seqs=8)
    before = ids(generate(engine, batch("a")), "a")
    assert engine.sleep(level=level).status == "SUCCESS"
    ack = engine.wake_up()
    assert ack.status == "SUCCESS" and ack.metadata.cuda_graph_recalled is True
    engine.resume()
    assert ids(generate(engine, batch("b")), "b") == before
    engine.shutdown()
