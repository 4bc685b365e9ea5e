"""New weights into the offline ``LLM`` from a trainer: in-process tensors (a state dict),
and vLLM's weight-transfer protocol for a trainer elsewhere (shared memory, gloo). Each
update's greedy answers equal transformers' on the same weights, a refused one changes
nothing, and a level-2 reload replays what was applied — not the trainer's tensors as they
are later."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.errors import InvalidRequestError
from omnistage.models.tiny import build_preset
from omnistage.rl import weights_checksum
from tests.unit.stage.shared_tensors import Shared, describe

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10], [100, 200, 300]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_preset("demo", tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def trainer(demo):
    """The trainer's model: transformers on the same checkpoint."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()


@pytest.fixture
def llm(demo):
    with LLM(str(demo), kv_cache_memory="4MiB", max_model_len=256, enable_sleep_mode=True) as llm:
        yield llm


def nudge(model, seed: int) -> dict[str, torch.Tensor]:
    """One "training step": every parameter moved a little, in place; the new state dict."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return dict(model.state_dict())


def answers(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def expected(model) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        out.append(generated[0, len(prompt) :].tolist())
    return out


def test_a_state_dict_in_place_as_a_version(llm, trainer, demo):
    import transformers

    assert llm.weight_version is None
    state = nudge(trainer, 1)
    (ack,) = llm.update_weights(state, weight_version=1)
    assert ack["status"] == "SUCCESS" and ack["metadata"]["weight_version"] == "1"
    assert llm.weight_version == "1"
    assert llm.weights_checksum() == weights_checksum(state.items())
    after = answers(llm)
    assert after == expected(trainer)
    version1 = {k: v.clone() for k, v in state.items()}  # ``state`` is the trainer's own
    # The trainer steps on (its tensors change in place); a level-2 sleep and reload brings
    # back version 1 as applied, from the LLM's own host copy.
    nudge(trainer, 2)
    llm.sleep(level=2)
    llm.wake_up()
    assert answers(llm) == after and llm.weight_version == "1"
    # (name, tensor) pairs, a partial update this time: version 2 on top of version 1.
    embed = "model.embed_tokens.weight"
    (ack,) = llm.update_weights([(embed, version1[embed] * 1.1)], weight_version="v2")
    assert ack["status"] == "SUCCESS" and llm.weight_version == "v2"
    reference = transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    reference.load_state_dict({**version1, embed: version1[embed] * 1.1})
    assert answers(llm) == expected(reference.eval())
    with pytest.raises(TypeError, match="weight_version"):
        llm.update_weights(str(demo), weight_version=3)
    (ack,) = llm.update_weights(str(demo))  # a checkpoint from disk: no version
    assert llm.weight_version is None


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda s: {**s, "model.norm.weight": torch.ones(3)}, "weights.model.norm.weight"),
        (
            lambda s: {**s, "model.norm.weight": s["model.norm.weight"].half()},
            "weights.model.norm.weight",
        ),
        (
            lambda s: {**s, "lm_head.weight": s["lm_head.weight"] * float("nan")},
            "weights.lm_head.weight",
        ),
        (lambda s: {**s, "bogus.weight": torch.zeros(2)}, "weights.bogus.weight"),
        (lambda s: {}, "weights"),
    ],
    ids=["shape", "dtype", "nan", "unknown", "empty"],
)
def test_a_refused_update_changes_nothing(llm, trainer, change, field):
    before, checksum = answers(llm), llm.weights_checksum()
    with pytest.raises(InvalidRequestError) as info:
        llm.update_weights(change(dict(trainer.state_dict())), weight_version="bad")
    assert info.value.field == field and "update_info" not in str(info.value)
    assert answers(llm) == before and llm.weights_checksum() == checksum
    assert llm.weight_version is None


def test_a_float_dtype_is_cast_when_asked(llm, trainer):
    state = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    (ack,) = llm.update_weights(state, weight_version=5, convert_dtypes=True)
    assert ack["status"] == "SUCCESS" and llm.weight_version == "5"


def test_vllms_transfer_protocol_over_shared_memory(llm, trainer):
    state = nudge(trainer, 3)
    named = sorted(state.items())
    assert llm.init_weight_transfer_engine({"backend": "ipc"})["backend"] == "ipc"
    llm.start_weight_update(describe(named))
    shared = Shared()
    try:
        half = len(named) // 2
        for chunk in (named[:half], named[half:]):
            (received,) = llm.update_weights({"update_info": shared.chunk(chunk)})
            assert received["received_tensors"] == len(chunk)
    finally:
        shared.close()
    (ack,) = llm.finish_weight_update(weight_version="ipc-1")
    assert ack["status"] == "SUCCESS" and llm.weight_version == "ipc-1"
    assert llm.weights_checksum() == weights_checksum(named)
    assert answers(llm) == expected(trainer)
    # Into the stage's own shared staging: each tensor written once, where start says.
    named = sorted(nudge(trainer, 5).items())
    first = llm.start_weight_update(describe(named, shared_staging=True))
    write_staged(named, first["staging"])
    (received,) = llm.update_weights({"update_info": describe(named, staged=True)})
    assert received["received_tensors"] == len(named)
    (ack,) = llm.finish_weight_update(weight_version="ipc-2")
    checksum, synced = weights_checksum(named), answers(llm)
    assert ack["status"] == "SUCCESS" and llm.weights_checksum() == checksum
    assert synced == expected(trainer)
    nudge(trainer, 6)  # the trainer steps on; a level-2 reload replays the staged copy
    llm.sleep(level=2)
    llm.wake_up()
    assert answers(llm) == synced and llm.weights_checksum() == checksum
    # The next update stages elsewhere: the reload source is never handed to a trainer.
    second = llm.start_weight_update(describe(named, shared_staging=True))
    assert not {p["shm"] for p in second["staging"]} & {p["shm"] for p in first["staging"]}
    write_staged([(named[0][0], named[0][1] * float("nan"))], second["staging"][:1])
    with pytest.raises(InvalidRequestError, match="NaN") as nan:
        llm.update_weights({"update_info": describe(named[:1], staged=True)})
    assert nan.value.field == f"update_info.names.{named[0][0]}"
    assert llm.weights_checksum() == checksum  # refused: the session ended, nothing applied
    llm.start_weight_update()
    with pytest.raises(InvalidRequestError) as unshared:
        llm.update_weights({"update_info": describe(named[:1], staged=True)})
    assert unshared.value.field == "update_info.staged"
    llm.start_weight_update()
    assert llm.abort_weight_update() == {"aborted": True}


def write_staged(named: list[tuple[str, torch.Tensor]], places: list[dict]) -> None:
    """What ``WeightSender`` does: each tensor's bytes into the stage's staging segment."""
    from omnistage.rl.sender import StagingSegment, _write

    for (_, tensor), place in zip(named, places, strict=True):
        segment = StagingSegment(place["shm"])
        _write(segment, place["offset"], tensor.detach().contiguous())
        segment.close()


def test_vllms_transfer_protocol_over_gloo_from_another_trainer(llm, trainer):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout,
                          wait_for_workers=False)  # fmt: skip
    group: list = []
    joining = threading.Thread(
        target=lambda: group.append(dist.ProcessGroupGloo(store, 0, 2, timeout))
    )
    joining.start()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "timeout_s": 30}
    assert llm.init_weight_transfer_engine({"init_info": init_info})["rank"] == 1
    joining.join(30)
    state = nudge(trainer, 4)
    named = sorted(state.items())
    llm.start_weight_update(describe(named))

    def broadcast() -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _, tensor in named:
            group[0].broadcast([tensor.contiguous()], opts).wait()

    sending = threading.Thread(target=broadcast)
    sending.start()
    (received,) = llm.update_weights({"update_info": describe(named)})
    sending.join(30)
    assert received["received_tensors"] == len(named)
    (ack,) = llm.finish_weight_update(weight_version=4)
    assert ack["status"] == "SUCCESS" and llm.weight_version == "4"
    assert answers(llm) == expected(trainer)
