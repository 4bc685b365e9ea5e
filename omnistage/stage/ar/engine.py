"""``ARStageEngine``: the autoregressive stage — continuous batching over a paged KV cache.

``step()`` is schedule → execute → update each sequence → multi-code frames. The engine owns
what runs once per stage (scheduler, blocks, sampler, requests); its ``ARWorker`` owns memory
(arena, weights, KV cache, sleep controller). A failed request (non-finite logits, a failed
batch) ends and the stage serves on; a process fault (out of memory, a CUDA error) ends the
process, which the server restarts (``docs/control-plane.md``)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from omnistage.config import ConfigError, StageConfig
from omnistage.errors import NonFiniteOutputError, StageAsleepError, StageInternalError
from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tokenizer import Tokenizer
from omnistage.stage.ar.block_manager import BlockManager
from omnistage.stage.ar.kv_cache import resolved_max_model_len
from omnistage.stage.ar.logprobs import position_logprobs, prompt_logprobs
from omnistage.stage.ar.multi_modal import modalities
from omnistage.stage.ar.output import ExecutedStep, abort_output, append_token, step_delta
from omnistage.stage.ar.ranks import TensorParallelWorker, make_worker
from omnistage.stage.ar.requests import RequestTable, embed_prompt_spec, from_wire
from omnistage.stage.ar.resolve import resolve_ar_stage
from omnistage.stage.ar.sampler import Sampler
from omnistage.stage.ar.scheduler import Scheduler
from omnistage.stage.ar.sequence import ARRequest, SequenceState
from omnistage.stage.ar.streamed_input import StreamedInput
from omnistage.stage.ar.wire import KIND, ARStageInfo
from omnistage.stage.ar.worker import ARWorker
from omnistage.stage.control import Ack
from omnistage.stage.engine_base import StageEngineBase
from omnistage.stage.faults import is_process_fault
from omnistage.stage.types import StageOutput
from omnistage.stage.vocabulary import KV_CACHE

logger = logging.getLogger(__name__)


class ARStageEngine(StreamedInput, StageEngineBase[ARWorker | TensorParallelWorker]):
    """One AR stage on one device. Not thread-safe: one caller drives it."""

    def __init__(
        self,
        config: StageConfig,
        arena: Arena | None = None,
        seed: int | None = None,
        *,
        load_weights: bool = True,
    ) -> None:
        if config.kind != KIND:
            raise ConfigError(f"kind: ARStageEngine needs an {KIND!r} stage, got {config.kind!r}")
        if config.preset is not None:
            from omnistage.models.tiny import ensure_preset

            ensure_preset(config.preset, config.model)
        self.model_config = ARModelConfig.from_pretrained(config.model, config.model_stage)
        if self.model_config.code_groups > 1 and config.tensor_parallel_size > 1:
            raise ConfigError(
                "tensor_parallel_size: a model with several codebooks per step runs on one rank"
            )
        config = resolve_ar_stage(config, self.model_config)  # dtype, max_model_len
        self.max_model_len = resolved_max_model_len(config)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        super().__init__(config, make_worker(config, self.model_config, arena, load_weights))
        self.block_manager = BlockManager(
            self.worker.num_kv_blocks, config.ar.block_size, config.ar.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.ar.max_num_seqs, config.ar.max_num_batched_tokens
        )
        # A stage whose tokens are codes stops on the request's stop ids only.
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids | set(self.model_config.eos_token_ids)
            if self.model_config.emits_text
            else set()
        )
        self.device = torch.device(config.device)
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        self.sampler = Sampler(
            self.eos_token_ids,
            generator,
            config.ar.logprobs_mode == "processed_logprobs",
            suppressed=self.model_config.suppress_token_ids,
        )
        self._held: list[SequenceState] = []  # arrived while paused; scheduled on resume
        self._awaiting: dict[str, Any] = {}  # streamed requests whose prompt has not come
        self._deferred: dict[str, Any] = {}  # their input that came while the stage slept
        self._queued_outputs: list[StageOutput] = []  # ended from outside (abort)
        self.requests = RequestTable(
            config,
            self.tokenizer,
            self.model_config.vocab_size,
            self.device,
            embed_dim=self.embedding_size,
            dtype=self.worker.runner.dtype,
            emits_text=self.model_config.emits_text,
            multi_modal=tuple(modalities(self.worker.runner.model)),
        )
        self._decoded = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False)
        )
        self._closed = False
        self.num_prefill_tokens = 0  # tokens computed by prefills (not taken from the cache)
        self.num_generated_tokens = 0  # tokens sampled (a stopped request adds none)

    def info(self) -> ARStageInfo:
        """What the API process needs to validate requests before they reach this stage, as
        the stage's model family sets requests up (``request_setup``)."""
        family = registry.ar_family(self.model_config.family)
        setup = family.request_setup(self.model_config, self.config.model)
        overrides = self.config.ar.override_generation_config
        if overrides:  # the stage's defaults over the model's, under each request's own
            setup["param_defaults"] = {**setup.get("param_defaults", {}), **overrides}
        return ARStageInfo(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.ar.max_num_seqs,
            embedding_size=self.embedding_size,
            emits_text=self.model_config.emits_text,
            multi_modal=list(self.requests.multi_modal),
            **setup,
        )

    @property
    def embedding_size(self) -> int:
        """The width of the input embeddings a request may give."""
        c = self.model_config
        return c.inputs_embeds_size or c.embedding_size or c.hidden_size

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request: ARRequest) -> None:
        """Queue a request (its ``n`` samples: one prefilled, the others fork from it); raises
        ``InvalidRequestError``, ``StageAsleepError``, ``WeightsInvalidError``."""
        if self._closed:
            raise RuntimeError(f"stage {self.stage_id} engine is shut down")
        if self.sleep_control.is_sleeping:
            raise StageAsleepError(self.stage_id)
        self.sleep_control.check_can_generate()
        embed_prompt_spec(request, self.worker.runner.model)  # if the model builds its prompt
        leader = self.requests.create(request)
        if request.embed_token_ids:
            leader.token_embeddings = self.worker.embed_tokens(request.embed_token_ids)
        if self._pause_mode is not None:
            self._held.append(leader)
        else:
            self.scheduler.add(leader)

    def add_wire_request(self, request_id: str, request: object) -> None:
        """``add_request`` for a request that came over the wire (``ARStageRequest``)."""
        self.add_request(from_wire(request_id, request))

    def abort(self, request_id: str) -> None:
        """End every sample of a request with ``finish_reason="abort"`` (delivered by the next
        ``step()``)."""
        self._drop_awaiting(request_id)
        for seq in self.requests.samples(request_id):
            self.scheduler.remove_sequence(seq)
            if seq in self._held:
                self._held.remove(seq)
            self._end(seq)

    def _end(self, seq: SequenceState, error: Exception | None = None) -> None:
        """Report ``seq`` (and the samples still to fork from it) ended from outside."""
        for ended in [seq, *seq.pending_samples]:
            self.requests.forget(ended)
            self._queued_outputs.append(abort_output(ended, "error" if error else "abort", error))
        seq.pending_samples = []

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.scheduler.has_unfinished() or self._held or self._queued_outputs or self._awaiting
        )

    def has_runnable_work(self) -> bool:
        """Whether a step would make progress even if it answered nothing: sequences that
        replay their tokens after a recompute (``SequenceState.rewind``) step with no output."""
        return self._can_run() and (
            any(seq.is_ready for seq in self.scheduler.running)
            or any(seq.replay for seq in self.scheduler.waiting)
        )

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

    def _run(self, seqs: list[SequenceState], is_prefill: bool) -> None:
        """Run the scheduled batch, then update each sequence from its row (its token, or its
        replayed one), then the batch's multi-code frames."""
        step = self._execute(seqs, is_prefill)
        if step is None:
            return
        framed: list[tuple[int, SequenceState, StageOutput]] = []  # go on to a multi-code frame
        for b, seq in enumerate(step.batch):
            row = b if step.rows is None else step.rows[b]
            output = self._update(step, b, row, seq)
            if output is not None and seq.finish_reason is None and step.last_hidden is not None:
                framed.append((row, seq, output))
        if framed:
            self._predict_frames(step.last_hidden, framed)

    def _execute(self, seqs: list[SequenceState], is_prefill: bool) -> ExecutedStep | None:
        """The model over ``seqs``, the forks a prefill lets join, and the draws of the
        sequences not replaying; None when the batch failed (its requests end with the error)."""
        if is_prefill:
            self.num_prefill_tokens += sum(s.num_tokens - s.num_cached_tokens for s in seqs)
        try:
            result = self.worker.execute(seqs, is_prefill)
            batch, rows = self._with_forks(seqs) if is_prefill else (seqs, None)
            logits = result.logits if rows is None else result.logits[rows]
            # Sequences replaying their tokens after a recompute draw nothing (their
            # generators stay where the first run left them).
            drawing = [b for b, seq in enumerate(batch) if not seq.replay]
            sampled = self.sampler(logits[drawing], [batch[b] for b in drawing])
        except Exception as exc:
            if is_process_fault(exc):
                raise
            logger.exception("stage %d: a batch of %d requests failed", self.stage_id, len(seqs))
            error = StageInternalError(f"{type(exc).__name__}: {exc}")
            for request_id in dict.fromkeys(seq.request_id for seq in seqs):
                for seq in self.requests.samples(request_id):
                    self._fail(seq, error)
            return None
        drawn = {b: i for i, b in enumerate(drawing)}
        return ExecutedStep(batch, rows, result, sampled, drawn, is_prefill)

    def _update(
        self, step: ExecutedStep, b: int, row: int, seq: SequenceState
    ) -> StageOutput | None:
        """``seq`` (batch position ``b``, logits row ``row``) after the step: its replayed or
        drawn token (hidden states, logprobs, stops, cached blocks); its output, if any."""
        result, is_prefill = step.result, step.is_prefill
        if seq.replay:  # the token it generated the first time; nothing to emit again
            if row in result.hidden_states:
                seq.record_hidden_states(result.hidden_states[row], is_prefill)
            seq.token_ids.append(seq.replay.pop(0))
            self.block_manager.cache_computed_blocks(seq)
            return None
        drawn = step.drawn[b]
        token_id = step.sampled.token_ids[drawn]
        if token_id is None:
            self._fail(seq, NonFiniteOutputError("the model produced NaN or infinite logits"))
            return None
        if row in result.hidden_states:
            seq.record_hidden_states(result.hidden_states[row], is_prefill)
        if row in result.prompt_logits and seq.prompt_logprobs is None:
            seq.prompt_logprobs = prompt_logprobs(
                result.prompt_logits[row],
                seq.token_ids[: seq.num_prompt_tokens],
                seq.params.prompt_logprobs or 0,
                self.decode_token,
            )
        entry = None
        if drawn in step.sampled.logprobs:
            entry = position_logprobs(
                step.sampled.logprobs[drawn], token_id, seq.params.logprobs or 0, self.decode_token
            )
        self.num_generated_tokens += 1
        output = append_token(seq, token_id, self.eos_token_ids, self.max_model_len, entry)
        if seq.stream_hidden_states or seq.context_token_ids:
            output.delta = step_delta(seq)
        self._queued_outputs.append(output)
        self.block_manager.cache_computed_blocks(seq)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.requests.forget(seq)
        return output

    def _predict_frames(
        self, last_hidden: torch.Tensor | None, framed: list[tuple[int, SequenceState, StageOutput]]
    ) -> None:
        """A multi-codebook model's other codes of this step's frames: each output then
        carries its step's whole frame (the sampled code first). A sequence whose step ended
        it gets none (its last code starts no frame)."""
        assert last_hidden is not None
        seqs = [seq for _, seq, _ in framed]
        try:
            codes = self.worker.predict_frames(
                last_hidden[[row for row, _, _ in framed]],
                [seq.last_token_id for seq in seqs],
                seqs,
                [seq.generator or self.sampler.generator for seq in seqs],
            )
        except Exception as exc:
            if is_process_fault(exc):
                raise
            logger.exception("stage %d: predicting %d frames failed", self.stage_id, len(seqs))
            for seq in seqs:
                self._fail(seq, StageInternalError(f"{type(exc).__name__}: {exc}"))
            return
        for (_, _, output), rest in zip(framed, codes, strict=True):
            output.new_token_ids.extend(rest)

    def _with_forks(
        self, seqs: list[SequenceState]
    ) -> tuple[list[SequenceState], list[int] | None]:
        """After a prefill: the samples waiting on it fork (sharing its prompt's k/v) and
        join the batch, each sampling from its leader's logits row."""
        if not any(seq.pending_samples for seq in seqs):
            return seqs, None
        batch, rows = list(seqs), list(range(len(seqs)))
        for i, leader in enumerate(seqs):
            for sample in leader.pending_samples:
                self._fork(leader, sample)
                batch.append(sample)
                rows.append(i)
            leader.pending_samples = []
        return batch, rows

    def _fork(self, leader: SequenceState, sample: SequenceState) -> None:
        copy = None
        if leader.num_tokens % self.block_manager.block_size:  # the next token goes there
            copy = self.block_manager.take_block()
            self.worker.copy_kv_block(leader.block_table[-1], copy)
        self.block_manager.share(leader, sample, copy)
        sample.hidden_states = list(leader.hidden_states)
        sample.prompt_logprobs = leader.prompt_logprobs
        self.scheduler.add_running(sample)

    def _fail(self, seq: SequenceState, error: Exception) -> None:
        self.scheduler.remove_sequence(seq)
        self._end(seq, error)

    def decode_token(self, token_id: int) -> str:
        """One token's text, as logprob entries show it (special tokens included)."""
        return self._decoded(token_id)

    # -- control: the kind's part of ``StageEngineBase`` ---------------------------------

    def _pause_requests(self, mode: str) -> tuple[int, int]:
        """``abort``: every request ends with "abort"; ``keep``: running requests are
        preempted and continue after ``resume()``; ``wait``: requests already here run to
        completion (see ``is_drained``). New requests queue until ``resume()``."""
        if mode == "abort":
            for request_id in list(self._awaiting):
                self._drop_awaiting(request_id)
            self._deferred.clear()
            seqs = [*self.scheduler.remove_all(), *self._held]
            self._held.clear()
            for seq in seqs:
                self._end(seq)
            return len(seqs), 0
        if mode == "keep":
            return 0, self.scheduler.preempt_all()
        return 0, 0

    def _resume_requests(self) -> None:
        for seq in self._held:
            self.scheduler.add(seq)
        self._held.clear()

    def is_drained(self) -> bool:
        """No request that was here before the pause is still waiting (for its streamed
        prompt too) or running."""
        return not (self.scheduler.has_unfinished() or self._awaiting)

    def drain_holders(self) -> list[str]:
        """The requests ``is_drained`` still waits for (a ``wait`` sleep's error names them)."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        return sorted({s.request_id for s in seqs} | set(self._awaiting))

    def _drop_memory_state(self) -> int:
        # KV contents die with the memory: whatever still holds blocks recomputes later.
        preempted = self.scheduler.preempt_all()
        self.block_manager.reset()
        return preempted

    def _after_wake(self, ack: Ack) -> None:
        if KV_CACHE in ack.metadata.tags:
            self.block_manager.reset()  # the cache came back empty
        if not self.sleep_control.is_sleeping:
            self.replay_deferred()

    def _after_weights_changed(self) -> None:
        self.block_manager.clear_cache()  # cached k/v came from the old weights
        self.worker.clear_encoder_cache()  # and so did cached encoder outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        self.block_manager.clear_cache()
        return True

    def status(self) -> dict[str, object]:
        return {
            **self.control_status(),
            "num_waiting": len(self.scheduler.waiting) + len(self._held),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_kv_blocks": self.worker.num_kv_blocks,
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "prefix_cache": self.block_manager.cache_status(),
            "encoder_cache": self.worker.encoder_cache_status(),
            "cuda_graphs": self.worker.has_cuda_graphs,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "rank_pids": getattr(self.worker, "rank_pids", []),  # ranks 1..N-1
            "memory": self.memory_stats(),
        }

    def shutdown(self) -> None:
        """Abort everything and free the arena (if this engine created it)."""
        if self._closed:
            return
        self._pause_requests("abort")
        self._closed = True
        self.worker.close()
