"""The offline Python API for one AR model, shaped like vLLM's ``LLM``.

    llm = LLM(model="path/to/checkpoint", enable_sleep_mode=True)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    llm.sleep(level=1); llm.wake_up()

Unlike the engine, ``wake_up`` resumes generation once nothing is asleep any more (the
offline API has no separate resume step to forget).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.config import offline_stage_config
from omnistage.errors import StageAsleepError
from omnistage.models.tokenizer import Tokenizer
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.logprobs import Logprob
from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.ar.wire import KIND
from omnistage.stage.control import Sleep, acks_of

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

PromptInput = str | dict[str, Any]


@dataclass
class CompletionOutput:
    """One sample: its text, tokens, and — when asked — per token, token id -> ``Logprob``
    (the sampled token and the top ``logprobs``), as vLLM's."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    hidden_states: torch.Tensor | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(entry[t].logprob for t, entry in zip(self.token_ids, self.logprobs, strict=True))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    """One AR model in this process. Extra keywords are ``StageConfig`` fields
    (``max_num_seqs``, ``kv_cache_bytes``, ``max_model_len``, ...); others raise ``TypeError``."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        enable_sleep_mode: bool = True,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
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
    ) -> list[RequestOutput]:
        """Generate for a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them;
        outputs come back in input order."""
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        inputs = [self._encode(p) for p in items]
        return self._run(inputs, sampling_params, return_hidden_states)

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them."""
        is_single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if is_single else list(messages)
        inputs: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            text = self.tokenizer.render_chat(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            inputs.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(inputs, sampling_params, False)

    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(
            f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
        )

    def _run(
        self,
        inputs: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        return_hidden_states: bool,
    ) -> list[RequestOutput]:
        if self.engine.is_sleeping():
            raise StageAsleepError(0, "the LLM is asleep; call wake_up() first")
        if self.engine.is_paused:
            raise RuntimeError("the LLM is paused; call resume() (or wake_up()) first")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(f"{len(params)} sampling_params for {len(inputs)} prompts")
        results: dict[str, RequestOutput] = {}
        try:
            for (text, ids), p in zip(inputs, params, strict=True):
                request_id = str(next(self._request_counter))
                self.engine.add_request(ARRequest(request_id, ids, p, return_hidden_states, text))
                samples = [CompletionOutput(i) for i in range(p.n)]
                results[request_id] = RequestOutput(request_id, text, ids, samples)
            self._drive(results)
        except BaseException:
            for request_id, result in results.items():
                if not result.finished:
                    self.engine.abort(request_id)
            self.engine.step()  # deliver the aborts so nothing is left behind
            raise
        return list(results.values())

    def _drive(self, results: dict[str, RequestOutput]) -> None:
        num_pending = sum(not r.finished for r in results.values())
        while num_pending:
            outputs = self.engine.step()
            if not outputs:
                raise RuntimeError(f"generation cannot progress: {self.engine.status()}")
            for out in outputs:
                result = results.get(out.request_id)
                if result is None:
                    continue
                completion = result.outputs[0]
                completion.text += out.text_delta
                completion.token_ids += out.new_token_ids
                if out.finished:
                    completion.finish_reason = out.finish_reason
                    if out.error is not None:
                        raise out.error
                    if out.handoff is not None:
                        completion.hidden_states = out.handoff.get("hidden_states")
                    result.finished = True
                    num_pending -= 1

    # -- control ------------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> list[dict[str, Any]]:
        """Release memory (level 1: weights to host, level 2: discard all); returns the ACKs,
        one per rank.

        Mode ``wait`` first runs the requests in flight to completion (within the config's
        ``drain_timeout_s``)."""
        Sleep(level=level, mode=mode)  # a bad level or mode is refused before anything pauses
        if mode != "wait" or self.engine.is_paused:
            return acks_of(self.engine.sleep(level=level, mode=mode))
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
            return acks_of(self.engine.sleep(level=level, mode=mode))
        except BaseException:
            self.engine.resume()  # a sleep that did not happen must not leave the LLM paused
            raise

    def wake_up(self, tags: Seq[str] | None = None, reload: bool = True) -> list[dict[str, Any]]:
        """Bring memory back; generation resumes once nothing is asleep."""
        ack = self.engine.wake_up(tags=tags, reload=reload)
        if not self.engine.is_sleeping():
            self.engine.resume()
        return acks_of(ack)

    def update_weights(self, path: str, check_finite: bool = True) -> list[dict[str, Any]]:
        """Load a safetensors file or folder into the weights in place (checked first)."""
        return acks_of(self.engine.update_weights(path, check_finite=check_finite))

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

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
