"""A request (``ARRequest``) and its life in the engine (``SequenceState``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from omnistage.models.tokenizer import IncrementalDetokenizer
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import MultiModalItem
from omnistage.stage.messages import TokenLogprobs
from omnistage.stage.types import FinishReason


@dataclass
class ARRequest:
    """What a client asks of an AR stage.

    With ``return_hidden_states`` the finished output carries ``handoff["hidden_states"]``:
    the final hidden states (after the last norm, on the CPU) of every token the model
    processed — the prompt and each generated token except the last, which is never fed back.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_hidden_states: bool = False
    prompt: str | None = None
    # See ``ARStageRequest``: embeddings in (a talker) and out (a thinker).
    hidden_states_with_embeddings: bool = False
    embed_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None
    token_embeds_from: int | None = None
    decode_embeds: torch.Tensor | None = None
    multi_modal: list[MultiModalItem] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [3, prompt tokens]: multimodal rotary positions
    position_delta: int = 0  # generated token i sits at i + position_delta
    text_embeddings_only: bool = False  # hidden states add no encoder output
    hidden_layer: int | None = None  # hand over this layer's hidden states (see ``Wants``)
    # Each output carries what the step added to the hand-off (a streamed edge's input).
    stream_hidden_states: bool = False
    prompt_spec: dict[str, Any] | None = None  # see ``ARStageRequest``
    forced_token_ids: list[int] | None = None  # the reply, said rather than drawn (ditto)
    # Ids the next stage takes before the generated ones (a cloned voice's reference codes,
    # set from ``prompt_spec``): the hand-off's ``token_ids`` start with them.
    context_token_ids: list[int] = field(default_factory=list)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class SequenceState:
    """A request's tokens, KV blocks, decoding state and streamed text."""

    def __init__(
        self,
        request: ARRequest,
        detokenizer: IncrementalDetokenizer | None,  # None: its tokens are codes, not text
        generator: torch.Generator | None,
        index: int = 0,
    ) -> None:
        self.request_id = request.request_id
        self.index = index  # which of the request's ``n`` samples this is
        self.params = request.sampling_params
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.return_hidden_states = request.return_hidden_states
        self.hidden_states_with_embeddings = request.hidden_states_with_embeddings
        self.text_embeddings_only = request.text_embeddings_only
        self.hidden_layer = request.hidden_layer
        self.stream_hidden_states = request.stream_hidden_states
        self.context_token_ids = list(request.context_token_ids)
        # A streamed input still open: its decode embeddings arrive while it runs, and a
        # step whose row has not arrived yet waits (``is_ready``).
        self.input_open = False
        self.num_streamed_rows = 0  # hidden-state rows its outputs carried (``delta``)
        self.embed_token_ids = request.embed_token_ids
        self.prompt_embeds = request.prompt_embeds
        self.token_embeds_from = request.token_embeds_from
        self.token_embeddings: torch.Tensor | None = None  # of embed_token_ids, on the CPU
        self.decode_embeds = request.decode_embeds
        self.multi_modal = list(request.multi_modal)  # placeholder ranges, in prompt order
        self.positions = request.positions
        self.position_delta = request.position_delta
        self.forced_token_ids = request.forced_token_ids
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # leading tokens whose k/v came from the prefix cache
        # The prompt tokens the prefix cache had at the first scheduling (vLLM's usage
        # ``prompt_tokens_details.cached_tokens``); a recompute after preemption does not count.
        self.num_prompt_cached_tokens: int | None = None
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.pending_samples: list[SequenceState] = []  # forked from this one after its prefill
        # Generated tokens fed back one decode step each after a recompute (``rewind``).
        self.replay: list[int] = []
        self.detokenizer = detokenizer
        self.generator = generator  # None: the engine's shared generator
        self.hidden_states: list[torch.Tensor] = []
        # Per generated token of a multi-codebook model: its other codes and their embedding,
        # which the token's next step adds to its own (``ModelRunner.predict_frames``).
        self.frame_embeds: list[torch.Tensor] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked for
        self.has_output = False  # prompt logprobs go out once, with the first output
        self.output_text = ""
        self.num_emitted_chars = 0
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic()
        self.queue_time_s: float | None = None  # set when first scheduled

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def forced_token(self) -> int | None:
        """The token its next step says (``forced_token_ids``), or None: it draws one."""
        forced = self.forced_token_ids
        if forced is None or self.num_output_tokens >= len(forced):
            return None
        return forced[self.num_output_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def kv_keyed_by_tokens(self) -> bool:
        """Whether its k/v follow from its token ids (and its multimodal items' content
        hashes) alone: only then may its blocks be found through the prefix cache."""
        return (
            self.prompt_embeds is None  # its ids do not say what its inputs are
            and self.decode_embeds is None
            and all(item.content_hash for item in self.multi_modal)
        )

    @property
    def may_use_prefix_cache(self) -> bool:
        """Whether its prefill may skip cached blocks: not when every prompt position's output
        (hidden states, prompt logprobs) is asked for."""
        return (
            self.kv_keyed_by_tokens
            and not self.return_hidden_states
            and self.params.prompt_logprobs is None
        )

    @property
    def has_input_embeds(self) -> bool:
        """Whether its model inputs are not (only) its tokens' embeddings."""
        return (
            self.prompt_embeds is not None
            or self.decode_embeds is not None
            or bool(self.frame_embeds)
        )

    @property
    def is_ready(self) -> bool:
        """Whether its next step has its input: every fed token's decode embedding has come
        (or its input is complete: the last row then repeats)."""
        if not self.input_open:
            return True
        rows = 0 if self.decode_embeds is None else len(self.decode_embeds)
        return rows >= self.num_output_tokens

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def recomputes_step_by_step(self) -> bool:
        """Whether a recompute after a preemption must repeat the steps that computed it
        rather than prefill every token at once: what it hands over (hidden states) depends
        on how each position was computed, not only on the tokens (a prefill of 60 tokens
        and 40 decode steps after a 20-token prefill agree to ~1e-6, not bit for bit — and
        an image conditioned on them then differs)."""
        return self.return_hidden_states

    def rewind(self) -> None:
        """Before a recompute (its blocks were freed): a step-by-step sequence keeps only its
        prompt; its generated tokens are fed back one decode step each (``replay``), making
        the same numbers as the first time. Other sequences recompute in one prefill."""
        if self.recomputes_step_by_step and self.num_output_tokens:
            self.replay = self.output_token_ids + self.replay
            del self.token_ids[self.num_prompt_tokens :]

    def record_hidden_states(self, rows: torch.Tensor, is_prefill: bool) -> None:
        # A prefill covers every token so far (recomputed after a preemption): it replaces.
        if is_prefill:
            self.hidden_states = [rows]
        else:
            self.hidden_states.append(rows)
