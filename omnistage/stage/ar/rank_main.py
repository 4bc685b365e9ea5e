"""Ranks 1..N-1 of a tensor-parallel AR stage: a process that joins the stage's group, builds
its ``ARWorker`` (its slices of the weights, the KV cache of its kv heads) and does what rank 0
sends it (``rank_wire``), answering control operations with its own ACK (see ``ranks.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zmq

from omnistage.config import StageConfig
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tensor_parallel import join_group
from omnistage.stage.ar.tp_weights import RankWeights
from omnistage.stage.ar.worker import ARWorker


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: the stage's for a host stage, the rank-th GPU from the stage's
    on CUDA (``cuda:1`` with 2 ranks: ranks on ``cuda:1`` and ``cuda:2``)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def follower_entry(
    config_json: str,
    rank: int,
    size: int,
    store: str,
    in_addr: str,
    out_addr: str,
    num_threads: int,
    load_weights: bool,
) -> None:
    """Spawn target of ranks 1..N-1 (imports the stage's code in the child)."""
    from omnistage.stage.proc import _die_with_parent, set_process_title

    _die_with_parent()
    config = StageConfig.model_validate_json(config_json)
    set_process_title(f"omnistage-stage{config.stage_id}-{config.display_name}-rank{rank}")
    torch.set_num_threads(num_threads)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    try:
        _serve_rank(config, rank, size, store, inbox, outbox, load_weights)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _serve_rank(
    config: StageConfig,
    rank: int,
    size: int,
    store: str,
    inbox: zmq.Socket[Any],
    outbox: zmq.Socket[Any],
    load_weights: bool,
) -> None:
    from omnistage.stage.ar import rank_wire as wire
    from omnistage.stage.ar.resolve import resolve_ar_stage
    from omnistage.stage.messages import WireError

    def reply(msg: wire.FromRank) -> None:
        outbox.send(wire.encode(msg))

    try:
        if config.device.startswith("cuda"):  # this rank's device, chosen by rank 0
            torch.cuda.set_device(torch.device(config.device))
        tp = join_group(store, rank, size, torch.device(config.device))
        model_config = ARModelConfig.from_pretrained(config.model, config.model_stage)
        config = resolve_ar_stage(config, model_config)
        worker = ARWorker(config, model_config, rank=rank, load_weights=load_weights, tp=tp)
    except BaseException as exc:
        reply(wire.RankFailed(rank, f"{type(exc).__name__}: {exc}"))
        raise
    reply(wire.RankReady(rank, worker.num_kv_blocks))
    control = rank_control(worker)
    synced = RankWeights(worker)
    control[wire.RankSyncPrepare] = lambda msg: synced.prepare_slices(msg.slices)
    control[wire.RankSyncCommit] = lambda msg: synced.commit(msg.version, msg.apply)
    try:
        while True:
            msg = wire.decode_to_rank(inbox.recv())
            if isinstance(msg, wire.RankStep):
                worker.execute(msg.seqs, msg.is_prefill)  # type: ignore[arg-type]
            elif isinstance(msg, wire.RankEmbed):
                worker.embed_tokens(msg.token_ids)
            elif isinstance(msg, wire.RankCopyKV):
                worker.copy_kv_block(msg.src, msg.dst)
            elif isinstance(msg, wire.RankControl | wire.RankSyncPrepare | wire.RankSyncCommit):
                op = msg.op if isinstance(msg, wire.RankControl) else msg
                try:
                    reply(wire.RankReply(rank, ack=control[type(op)](op)))
                except Exception as exc:  # answered, like the stage channel's errors
                    reply(wire.RankReply(rank, error=WireError.from_exception(exc)))
            elif isinstance(msg, wire.RankShutdown):
                return
    finally:
        worker.close()


def rank_control(worker: ARWorker) -> dict[type, Callable[[Any], Any]]:
    """The control operations a rank serves, by type (its own memory and weights)."""
    from omnistage.stage import control as ops

    return {
        ops.Sleep: lambda op: worker.sleep(op.level, op.tags, mode=op.mode),
        ops.WakeUp: lambda op: worker.wake_up(op.tags, op.reload),
        ops.UpdateWeights: lambda op: worker.update_weights(op.path, op.check_finite),
        ops.AdoptHistory: lambda op: worker.adopt_history(op.sources, load=op.load),
    }
