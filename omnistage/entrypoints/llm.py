"""The offline Python API for one AR model, shaped like vLLM's ``LLM``: what in-process RL
rollouts drive, as verl and OpenRLHF drive vLLM's.

    llm = LLM(model="path/to/checkpoint", enable_sleep_mode=True)
    outputs = llm.generate(["Hello"], SamplingParams(n=4, logprobs=1, seed=0, max_tokens=32))
    llm.sleep(level=1, tags=["kv_cache"])             # while the trainer trains
    llm.update_weights(model.state_dict(), weight_version=1)
    llm.wake_up()

A request is prepared as the server prepares it (``ARRequestPreparer``: tokenization, the
model family's defaults, the same checks), so an answer equals the HTTP path's for the same
request. Keywords are the server's flags' names with its defaults (``kv_cache_memory``,
``enable_sleep_mode=False``, ``dtype="auto"``); errors name the Python keyword or method.
Unlike the engine, ``wake_up`` resumes generation once nothing is asleep any more (the
offline API has no separate resume step to forget).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any, TypeVar

from omnistage.config import offline_stage_config
from omnistage.entrypoints.llm_outputs import CompletionOutput, RequestOutput, add_output
from omnistage.entrypoints.llm_vllm_args import refuse_call_arguments, vllm_arguments
from omnistage.entrypoints.llm_weights import InProcessWeights, NamedTensors, reworded
from omnistage.entrypoints.offline import params_per_input
from omnistage.errors import SleepModeDisabledError, StageAsleepError, WeightsInvalidError
from omnistage.models.processors import Wants
from omnistage.models.tokenizer import Tokenizer
from omnistage.rl.bounds import check_weight_version
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.logprobs import Logprob
from omnistage.stage.ar.request_preparer import ARRequestPreparer
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import KIND
from omnistage.stage.background import run_to_answer
from omnistage.stage.control import Sleep, acks_of
from omnistage.stage.request_preparer import RequestOptions, prompt_fields
from omnistage.stage.vocabulary import check_tags

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

PromptInput = str | Mapping[str, Any]
T = TypeVar("T")
_DEFAULTS = SamplingParams()


def _changed_fields(params: SamplingParams) -> dict[str, Any]:
    """The fields ``params`` sets away from their defaults: what an HTTP request would send
    (a model family's own defaults then apply under them, as on the server)."""
    return {
        name: getattr(params, name)
        for name in params.__struct_fields__
        if getattr(params, name) != getattr(_DEFAULTS, name)
    }


class LLM:
    """One AR model in this process. Extra keywords are the server's per-stage settings
    (``max_num_seqs``, ``max_model_len``, ``kv_cache_memory``, ``tensor_parallel_size``, ...,
    any ``StageConfig`` field); others raise ``TypeError`` naming them."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        enable_sleep_mode: bool = False,
        seed: int | None = None,
        kv_cache_memory: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        if kv_cache_memory is not None:
            kwargs["kv_cache_memory"] = kv_cache_memory
        kwargs = vllm_arguments(model, kwargs)
        config = offline_stage_config(
            "LLM",
            KIND,
            model,
            device=device,
            dtype=dtype,
            enable_sleep_mode=enable_sleep_mode,
            **kwargs,
        )
        self.engine = ARStageEngine(config, seed=seed)
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self._preparer = ARRequestPreparer(self.engine.config, self.engine.info())
        self._weights = InProcessWeights(self.engine)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # -- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        return_hidden_states: bool = False,
        use_tqdm: bool = False,
        **vllm_only: Any,
    ) -> list[RequestOutput]:
        """Generate for a string, a ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}``
        dict (with ``multi_modal_data`` for a model with encoders), or a list of them; one
        ``SamplingParams`` for all or one per prompt. Outputs come back in input order.
        ``use_tqdm``: a progress bar of finished prompts (vLLM's)."""
        refuse_call_arguments("generate", vllm_only)
        items = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        prompts_ = [self._prompt(p) for p in items]
        return self._run(prompts_, sampling_params, return_hidden_states, use_tqdm)

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        **vllm_only: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them,
        rendered by the checkpoint's chat template as the server's chat route renders them."""
        refuse_call_arguments("chat", vllm_only)
        is_single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if is_single else list(messages)
        prompts: list[tuple[str | None, dict[str, Any]]] = []
        for conversation in conversations:
            text = self.tokenizer.render_chat(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template's own
            prompts.append((text, {"prompt_token_ids": ids}))
        return self._run(prompts, sampling_params, False, use_tqdm)

    def _prompt(self, prompt: PromptInput) -> tuple[str | None, dict[str, Any]]:
        """The prompt's text (for the record) and its fields for the preparer."""
        if isinstance(prompt, str):
            return prompt, {"prompt": prompt}
        if not isinstance(prompt, Mapping):
            raise TypeError(
                "a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', "
                f"got {type(prompt).__name__}"
            )
        text = prompt.get("prompt")
        fields = dict(prompt)
        if "prompt_token_ids" in fields:  # a text given beside the ids is the record only
            fields.pop("prompt", None)
        fields = prompt_fields(fields, ARRequestPreparer.PROMPT_FIELDS)
        return (text if isinstance(text, str) else None), fields

    def _run(
        self,
        prompts: list[tuple[str | None, dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        return_hidden_states: bool,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if self.engine.is_sleeping():
            raise StageAsleepError(0, "the LLM is asleep; call wake_up() first")
        if self.engine.is_paused:
            raise RuntimeError("the LLM is paused; call resume() (or wake_up()) first")
        if not self.engine.sleep_control.weights_valid:
            raise reworded(
                WeightsInvalidError(0),
                "the LLM's weights were discarded by sleep(level=2) and woken with "
                "wake_up(reload=False); call update_weights(...) or wake_up(reload=True) first",
            )
        params = params_per_input(
            sampling_params, SamplingParams, len(prompts), ("sampling_params", "prompts")
        )
        wants = Wants(hidden_states=return_hidden_states)
        requests = [  # every prompt is checked before any starts
            (text, self._preparer.prepare(fields, RequestOptions.of(sampling_params=p), wants))
            for (text, fields), p in zip(prompts, map(_changed_fields, params), strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        try:
            for text, request in requests:
                request_id = str(next(self._request_counter))
                self.engine.add_wire_request(request_id, request)
                samples = [CompletionOutput(i) for i in range(request.sampling_params.n)]
                ids = list(request.prompt_token_ids)
                results[request_id] = RequestOutput(request_id, text, ids, samples)
            self._drive(results, use_tqdm)
        except BaseException:
            for request_id, result in results.items():
                if not result.finished:
                    self.engine.abort(request_id)
            self.engine.step()  # deliver the aborts so nothing is left behind
            raise
        return list(results.values())

    def _drive(self, results: dict[str, RequestOutput], use_tqdm: bool = False) -> None:
        """Step the engine until every sample of every request has finished (``use_tqdm``:
        a progress bar of finished prompts)."""
        unfinished = {rid: len(r.outputs) for rid, r in results.items()}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(results), desc="Processed prompts", unit="prompt")
        try:
            self._step_until_done(results, unfinished, bar)
        finally:
            if bar is not None:
                bar.close()

    def _step_until_done(
        self, results: dict[str, RequestOutput], unfinished: dict[str, int], bar: Any
    ) -> None:
        while unfinished:
            outputs = self.engine.step()
            if not outputs and not self.engine.has_runnable_work():
                raise RuntimeError(f"generation cannot progress: {self.engine.status()}")
            for out in outputs:
                result = results.get(out.request_id)
                if result is None:
                    continue
                if out.error is not None:
                    raise out.error
                if not add_output(result, out):
                    continue
                unfinished[out.request_id] -= 1
                if not unfinished[out.request_id]:
                    del unfinished[out.request_id]
                    result.finished = True
                    if bar is not None:
                        bar.update(1)

    # -- sleep and wake -------------------------------------------------------------------

    def _require_sleep_mode(self, method: str) -> None:
        if not self.engine.config.enable_sleep_mode:
            raise reworded(
                SleepModeDisabledError(0),
                f"{method}() needs sleep mode: create the LLM with "
                "LLM(..., enable_sleep_mode=True)",
            )

    def sleep(
        self, level: int = 1, tags: Seq[str] | None = None, mode: str = "abort"
    ) -> list[dict[str, Any]]:
        """Release memory (level 1: weights to host, level 2: discard them; the KV cache is
        released at either), only the memory of ``tags`` if given (``["kv_cache"]``: keep the
        weights); returns the ACKs, one per rank. Mode ``wait`` first runs the requests in
        flight to completion (within the config's ``drain_timeout_s``)."""
        self._require_sleep_mode("sleep")
        # A bad level, mode or tag is refused before anything pauses.
        Sleep(level=level, mode=mode, tags=None if tags is None else list(tags))
        check_tags(tags, self.engine.arena.tags)
        if mode != "wait" or self.engine.is_paused:
            return acks_of(self.engine.sleep(level=level, mode=mode, tags=tags))
        self.engine.pause("wait")
        try:
            deadline = time.monotonic() + self.engine.config.drain_timeout_s
            while not self.engine.is_drained():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        "sleep(mode='wait'): requests still running after "
                        f"{self.engine.config.drain_timeout_s:g}s; raise drain_timeout_s"
                    )
                self.engine.step()
            return acks_of(self.engine.sleep(level=level, mode=mode, tags=tags))
        except BaseException:
            self.engine.resume()  # a sleep that did not happen must not leave the LLM paused
            raise

    def wake_up(self, tags: Seq[str] | None = None, reload: bool = True) -> list[dict[str, Any]]:
        """Bring memory back (only that of ``tags`` if given); generation resumes once
        nothing is asleep. ``reload=False`` leaves level-2-discarded weights to
        ``update_weights``."""
        self._require_sleep_mode("wake_up")
        ack = self.engine.wake_up(tags=tags, reload=reload)
        if not self.engine.is_sleeping():
            self.engine.resume()
        return acks_of(ack)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (weight changes and sleeps do this by themselves)."""
        return self.engine.reset_prefix_cache()

    # -- weights --------------------------------------------------------------------------

    def update_weights(
        self,
        weights: str | os.PathLike[str] | NamedTensors,
        weight_version: str | int | None = None,
        *,
        check_finite: bool = True,
        convert_dtypes: bool = False,
    ) -> list[dict[str, Any]]:
        """New weights, in place; returns the ACKs. ``weights`` is a safetensors file or
        folder, or a trainer's tensors — a state dict or ``(name, tensor)`` pairs, by
        checkpoint name — checked first (names, shapes, dtypes; NaN/Inf unless
        ``check_finite`` is False), applied all or nothing, and labelled ``weight_version``
        (``convert_dtypes``: a float tensor may differ in dtype from its weight). Or vLLM's
        ``{"update_info": {...}}``: one chunk of a transfer session (``start_weight_update``
        ... ``finish_weight_update``)."""
        if isinstance(weights, str | os.PathLike):
            if weight_version is not None:
                raise TypeError(
                    "update_weights(path): weight_version labels a trainer's tensors; a "
                    "checkpoint from disk carries none"
                )
            path = os.fspath(weights)
            return acks_of(self.engine.update_weights(path, check_finite=check_finite))
        if isinstance(weights, Mapping) and "update_info" in weights:
            chunk = self.engine.weight_sync.receive_weights(dict(weights["update_info"]))
            return [run_to_answer(chunk)]
        return acks_of(
            self._weights.apply(
                weights, weight_version, check_finite=check_finite, convert_dtypes=convert_dtypes
            )
        )

    @property
    def weight_version(self) -> str | None:
        """The version of the trainer's weights serving (None: the checkpoint's)."""
        return self.engine.weight_version

    def weights_checksum(self) -> str:
        """``omnistage.rl.weights_checksum`` of the live weights (compare the trainer's)."""
        return self.engine.weight_sync.weights_checksum()

    # vLLM's weight-transfer protocol, for a trainer in another process (a Ray actor's
    # LLM): ``init`` once, then per update ``start`` -> ``update_weights({"update_info":
    # ...})``* -> ``finish``. The LLM is the session's one caller: no session ids.

    def init_weight_transfer_engine(
        self, request: Mapping[str, Any] | None = None, *, abort_open: bool = False
    ) -> dict[str, Any]:
        """Join the trainer: ``{"backend": "nccl", "init_info": {"master_address",
        "master_port", "rank_offset", "world_size", "timeout_s"}}`` (blocks until the
        trainer's rank 0 is there), or ``{"backend": "ipc"}``."""
        request = dict(request or {})
        sync = self.engine.weight_sync
        answer: dict[str, Any] = run_to_answer(
            sync.init_weight_transfer(
                request.get("backend", "nccl"), request.get("init_info"), abort_open
            )
        )
        return answer

    def start_weight_update(
        self, update_info: Mapping[str, Any] | None = None, *, abort_open: bool = False
    ) -> dict[str, Any]:
        """Open an update; announcing every tensor (``update_info``) checks them now."""
        info = None if update_info is None else dict(update_info)
        answer: dict[str, Any] = run_to_answer(
            self.engine.weight_sync.start_weight_update(info, abort_open=abort_open)
        )
        return answer

    def finish_weight_update(self, weight_version: str | int | None = None) -> list[dict[str, Any]]:
        """Apply the update in place, all or nothing, as ``weight_version``."""
        version = None if weight_version is None else check_weight_version(weight_version)
        return acks_of(self.engine.weight_sync.finish_weight_update(version))

    def abort_weight_update(self) -> dict[str, Any]:
        return self.engine.weight_sync.abort_weight_update()

    # -- the rest -------------------------------------------------------------------------

    def collective_rpc(
        self, method: Callable[..., T], *, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[T]:
        """vLLM's: ``method(worker, *args, **kwargs)`` on every rank's worker, their results
        in rank order. A callable only: omnistage dispatches no method by name (its control
        operations are this class's methods)."""
        if isinstance(method, str) or not callable(method):
            raise TypeError(
                "collective_rpc takes a callable f(worker, *args, **kwargs), not a method "
                f"name ({method!r}); use LLM's own methods (sleep, wake_up, update_weights, "
                "reset_prefix_cache, ...)"
            )
        if self.engine.config.tensor_parallel_size > 1:
            raise NotImplementedError(
                "collective_rpc reaches the worker in this process only; ranks 1.. of "
                f"tensor_parallel_size={self.engine.config.tensor_parallel_size} run in "
                "processes of their own"
            )
        return [method(self.engine.worker, *args, **(kwargs or {}))]

    def memory_stats(self) -> dict[str, Any]:
        return self.engine.memory_stats()

    def pause(self, mode: str = "abort") -> None:
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def status(self) -> dict[str, Any]:
        return self.engine.status()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
