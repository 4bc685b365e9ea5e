"""``ARStageEngine``: the autoregressive stage — continuous batching over a paged KV cache.

``step()`` is schedule → run → postprocess. The engine owns what runs once per stage (the
scheduler, block bookkeeping, sampler, the requests); its ``ARWorker`` owns memory (arena,
weights, KV cache, sleep controller). Control: ``pause(mode)`` decides what happens to
requests; ``sleep`` pauses (if not paused), resets the KV state and lets the worker release
memory. After ``wake_up`` the engine stays paused until ``resume()``: the caller decides when
generation restarts (see ``docs/control-plane.md``).

A failure that belongs to requests (non-finite logits, an error while running a batch) ends
those requests with an error and the stage keeps serving; a fault of the process itself
(out of memory, a CUDA error) propagates and ends the process, which the server restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from omnistage.config import ConfigError, StageConfig
from omnistage.errors import (
    InvalidRequestError,
    NonFiniteOutputError,
    SleepModeDisabledError,
    StageAsleepError,
    StageInternalError,
)
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tokenizer import IncrementalDetokenizer, Tokenizer
from omnistage.stage.ar.block_manager import BlockManager
from omnistage.stage.ar.kv_cache import KV_CACHE_TAG
from omnistage.stage.ar.output import abort_output, append_token
from omnistage.stage.ar.sampler import Sampler
from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.ar.scheduler import Scheduler
from omnistage.stage.ar.sequence import ARRequest, Sequence
from omnistage.stage.ar.worker import ARWorker
from omnistage.stage.faults import is_process_fault
from omnistage.stage.messages import Ack, ARStageInfo, ARStageRequest
from omnistage.stage.sleep_args import check_level, check_mode
from omnistage.stage.sleep_control import SleepController
from omnistage.stage.types import StageOutput

logger = logging.getLogger(__name__)


class ARStageEngine:
    """One AR stage on one device. Not thread-safe: one caller drives it."""

    def __init__(
        self,
        config: StageConfig,
        arena: Arena | None = None,
        seed: int | None = None,
        *,
        load_weights: bool = True,
    ) -> None:
        if config.kind != "ar":
            raise ConfigError(f"kind: ARStageEngine needs an 'ar' stage, got {config.kind!r}")
        if config.preset is not None:
            from omnistage.models.tiny import ensure_preset

            ensure_preset(config.preset, config.model)
        self.config = config
        self.stage_id = config.stage_id
        self.model_config = ARModelConfig.from_pretrained(config.model)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.worker = ARWorker(config, self.model_config, arena=arena, load_weights=load_weights)
        self.block_manager = BlockManager(self.worker.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.eos_token_ids = self.tokenizer.eos_token_ids | set(self.model_config.eos_token_ids)
        self.device = torch.device(config.device)
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        self.sampler = Sampler(self.eos_token_ids, generator)
        self._held: list[Sequence] = []  # arrived while paused; scheduled on resume
        self._queued_outputs: list[StageOutput] = []  # ended from outside (abort)
        self._request_ids: set[str] = set()
        self._pause_mode: str | None = None
        self._closed = False

    @property
    def sleep_control(self) -> SleepController:
        return self.worker.sleep_control

    @property
    def arena(self) -> Arena:
        return self.worker.arena

    def info(self) -> ARStageInfo:
        """What the API process needs to validate requests before they reach this stage."""
        return ARStageInfo(
            vocab_size=self.model_config.vocab_size, max_model_len=self.config.max_model_len
        )

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request: ARRequest) -> None:
        """Queue a request; raises ``InvalidRequestError`` naming a bad field,
        ``StageAsleepError`` while asleep, ``WeightsInvalidError`` without valid weights."""
        if self._closed:
            raise RuntimeError(f"stage {self.stage_id} engine is shut down")
        if self.sleep_control.is_sleeping:
            raise StageAsleepError(self.stage_id)
        self.sleep_control.check_can_generate()
        self._validate(request)
        params = request.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        seq = Sequence(request, detokenizer, generator)
        self._request_ids.add(request.request_id)
        if self._pause_mode is not None:
            self._held.append(seq)
        else:
            self.scheduler.add(seq)

    def add_wire_request(self, request_id: str, request: object) -> None:
        """``add_request`` for a request that came over the wire (``ARStageRequest``)."""
        if not isinstance(request, ARStageRequest):
            raise InvalidRequestError(
                "request", f"an AR stage takes 'ar' requests, got {type(request).__name__}"
            )
        self.add_request(
            ARRequest(
                request_id,
                list(request.prompt_token_ids),
                request.sampling_params,
                request.return_hidden_states,
                request.prompt,
            )
        )

    def _validate(self, request: ARRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request.request_id in self._request_ids:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        if not isinstance(request.sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        ids = request.prompt_token_ids
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list | tuple) or not ids:
            raise InvalidRequestError("prompt", "must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(ids)} tokens leave no room to generate within "
                f"max_model_len={self.config.max_model_len}",
            )

    def abort(self, request_id: str) -> None:
        """End a request with ``finish_reason="abort"`` (delivered by the next ``step()``)."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            seq = next((s for s in self._held if s.request_id == request_id), None)
            if seq is None:
                return  # finished or unknown: nothing to do
            self._held.remove(seq)
        self._end(seq)

    def _end(self, seq: Sequence, error: Exception | None = None) -> None:
        self._request_ids.discard(seq.request_id)
        self._queued_outputs.append(abort_output(seq, "error" if error else "abort", error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self._held or self._queued_outputs)

    # -- the loop -----------------------------------------------------------------------

    def _can_run(self) -> bool:
        if self._pause_mode not in (None, "wait"):
            return False
        return not self.sleep_control.is_sleeping and self.sleep_control.weights_valid

    def step(self) -> list[StageOutput]:
        """One round: schedule → run → postprocess. Queued outputs (aborts) always come out."""
        if self._can_run():
            seqs, is_prefill = self.scheduler.schedule()
            if seqs:
                self._run(seqs, is_prefill)
        outputs, self._queued_outputs = self._queued_outputs, []
        return outputs

    def _run(self, seqs: list[Sequence], is_prefill: bool) -> None:
        try:
            result = self.worker.execute(seqs, is_prefill)
            token_ids = self.sampler(result.logits, seqs)
        except Exception as exc:
            if is_process_fault(exc):
                raise
            logger.exception("stage %d: a batch of %d requests failed", self.stage_id, len(seqs))
            for seq in seqs:
                self._fail(seq, StageInternalError(f"{type(exc).__name__}: {exc}"))
            return
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids, strict=True)):
            if token_id is None:
                self._fail(seq, NonFiniteOutputError("the model produced NaN or infinite logits"))
                continue
            if i in result.hidden_states:
                seq.record_hidden_states(result.hidden_states[i], is_prefill)
            self._queued_outputs.append(
                append_token(seq, token_id, self.eos_token_ids, self.config.max_model_len)
            )
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self._request_ids.discard(seq.request_id)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        self.scheduler.finish(seq)
        self._end(seq, error)

    # -- control ------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    def pause(self, mode: str = "abort") -> None:
        """Stop scheduling. ``abort``: every request ends with "abort"; ``keep``: running
        requests are preempted and continue after ``resume()``; ``wait``: requests already
        here run to completion (see ``is_drained``). New requests queue until ``resume()``."""
        self._pause(mode)

    def _pause(self, mode: str) -> tuple[int, int]:
        check_mode(mode)
        aborted = preempted = 0
        if mode == "abort":
            seqs = [*self.scheduler.remove_all(), *self._held]
            self._held.clear()
            for seq in seqs:
                self._end(seq)
            aborted = len(seqs)
        elif mode == "keep":
            preempted = self.scheduler.preempt_all()
        self._pause_mode = mode
        return aborted, preempted

    def resume(self) -> None:
        self._pause_mode = None
        for seq in self._held:
            self.scheduler.add(seq)
        self._held.clear()

    def is_drained(self) -> bool:
        """No request that was here before the pause is still waiting or running."""
        return not self.scheduler.has_unfinished()

    def _check_sleep_enabled(self) -> None:
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError(self.stage_id)

    def sleep(self, level: int = 2, mode: str = "abort", tags: Seq[str] | None = None) -> Ack:
        """Pause with ``mode`` (unless already paused), reset the KV state and release memory.

        With mode ``wait`` the requests must have drained first: the caller drives ``step()``
        until ``is_drained()`` (bounded by ``drain_timeout_s``), else ``RuntimeError``.
        """
        self._check_sleep_enabled()
        check_mode(mode)
        check_level(level)
        unknown = [t for t in tags or () if not self.arena.has_tag(t)]
        if unknown:
            raise InvalidRequestError(
                "tags", f"unknown tags {unknown}; this stage has {self.arena.tags}"
            )
        aborted = preempted = 0
        if self._pause_mode is None:
            aborted, preempted = self._pause(mode)
        effective_mode = self._pause_mode
        if effective_mode == "wait" and not self.is_drained():
            raise RuntimeError(
                "sleep(mode='wait'): requests are still running; call step() until is_drained() "
                "(bounded by drain_timeout_s), then sleep again"
            )
        if level >= 1:
            # KV contents die with the memory: whatever still holds blocks recomputes later.
            preempted += self.scheduler.preempt_all()
            self.block_manager.reset()
        return self.worker.sleep(
            level, tags, mode=effective_mode, aborted=aborted, preempted=preempted
        )

    def wake_up(self, tags: Seq[str] | None = None, reload: bool = True) -> Ack:
        """Bring memory back (weights reloaded after level 2 unless ``reload`` is False).
        Stays paused: call ``resume()`` to generate again."""
        self._check_sleep_enabled()
        kv_was_asleep = self.arena.is_asleep(KV_CACHE_TAG)
        ack = self.worker.wake_up(tags, reload)
        if kv_was_asleep and not self.arena.is_asleep(KV_CACHE_TAG):
            self.block_manager.reset()  # the cache came back empty
        return ack

    def update_weights(self, path: str, check_finite: bool = True) -> Ack:
        """Load a safetensors file or folder into the (awake) weights in place."""
        return self.worker.update_weights(path, check_finite=check_finite)

    def is_sleeping(self) -> bool:
        return self.sleep_control.is_sleeping

    def memory_stats(self) -> dict[str, object]:
        return self.sleep_control.memory_stats()

    def status(self) -> dict[str, object]:
        control = self.sleep_control
        return {
            "stage_id": self.stage_id,
            "kind": "ar",
            "level": control.level,
            "is_sleeping": control.is_sleeping,
            "sleeping_tags": control.sleeping_tags,
            "is_paused": self.is_paused,
            "pause_mode": self._pause_mode,
            "weights_valid": control.weights_valid,
            "weight_sources": control.weight_sources,
            "num_waiting": len(self.scheduler.waiting) + len(self._held),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_kv_blocks": self.worker.num_kv_blocks,
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "cuda_graphs": self.worker.has_cuda_graphs,
            "memory": control.memory_stats(),
        }

    def shutdown(self) -> None:
        """Abort everything and free the arena (if this engine created it)."""
        if self._closed:
            return
        self._pause("abort")
        self._closed = True
        self.worker.close()
