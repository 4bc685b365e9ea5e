"""Continuous batching: each step is either a prefill of waiting sequences or one decode
token for every running sequence; when the KV cache runs out, the newest running sequences
are preempted (their blocks freed, their tokens kept) and later recomputed.

A sequence whose request asked for ``n`` samples is scheduled with room for the ``n - 1``
samples that fork from it after its prefill (a sequence slot and a copied block each).

With prefix caching, a prompt whose next uncached block another prefill of the same step
computes waits for the next step (and the prompts behind it, in order): it then finds those
blocks cached instead of computing them a second time (GRPO's prompts of one system
prefix, arriving together).

Fair share: when a request with nothing running waits for room that another request holds
beyond its share (``max_num_seqs`` over the requests running, plus the waiting one), that
request's newest sequences are preempted — behind the newcomer — until the newcomer fits. A
request of ``n = max_num_seqs`` long samples thus cannot make a 2-token request wait for all
of them; its preempted samples resume (recomputing their KV, same tokens) once there is room.
The same holds when the KV cache, not the slots, runs out: a request with nothing running
goes before the samples other requests had preempted (their excess, waiting first in line),
and a decode that runs out of blocks preempts the newest sequence of the request holding
the most, never a newcomer beside it.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from omnistage.stage.ar.block_manager import BlockManager
from omnistage.stage.ar.sequence import SequenceState, SequenceStatus


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceState] = deque()
        self.running: deque[SequenceState] = deque()
        self.num_preemptions = 0

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[SequenceState], bool]:
        """The sequences to run now and whether this is a prefill step."""
        scheduled: list[SequenceState] = []
        num_batched_tokens = 0
        num_slots = len(self.running)
        computing: set[bytes] = set()  # prefix blocks this step's prefills compute
        self._newcomers_first()
        while self.waiting:
            seq = self.waiting[0]
            if not seq.is_ready:
                break  # a recompute whose streamed input has not caught up
            if scheduled and self.block_manager.waits_for(seq, computing):
                break  # its prefix is computed now: a step later it is a cache hit
            forks = len(seq.pending_samples)
            fits = num_slots + 1 + forks <= self.max_num_seqs
            if not (fits and self.block_manager.can_allocate(seq, forks)):
                if scheduled or not self._preempt_for(seq, 1 + forks):
                    break
                num_slots = len(self.running)
                continue
            # The first sequence always goes, so prompts longer than the budget still run.
            too_many = num_batched_tokens + seq.num_tokens > self.max_num_batched_tokens
            if scheduled and too_many:
                break
            num_slots += 1 + forks
            self.block_manager.allocate(seq)
            computing |= self.block_manager.computing(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.queue_time_s is None:
                seq.queue_time_s = time.monotonic() - seq.arrival_time
            num_batched_tokens += seq.num_tokens
            scheduled.append(self.waiting.popleft())
        if scheduled:
            self.running.extend(scheduled)
            return scheduled, True
        # Sequences waiting for their streamed input sit this step out, in their places.
        idle = [seq for seq in self.running if not seq.is_ready]
        if idle:
            self.running = deque(seq for seq in self.running if seq.is_ready)
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                victim = self._decode_victim(seq, scheduled)
                if victim is seq:
                    self.preempt(seq)
                    break
                self.running.remove(victim)
                self.preempt(victim)
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        self.running.extend(idle)
        return scheduled, False

    def _newcomers_first(self) -> None:
        """Fair share in line: when the first waiting sequence belongs to a request that has
        sequences running (its excess, preempted), the ready sequences of requests with
        nothing running go before it, each group in its own order."""
        if len(self.waiting) < 2 or not self.running:
            return
        running = {s.request_id for s in self.running}
        if self.waiting[0].request_id not in running:
            return
        first = [s for s in self.waiting if s.request_id not in running and s.is_ready]
        if first:
            chosen = {id(s) for s in first}
            self.waiting = deque(first + [s for s in self.waiting if id(s) not in chosen])

    def _decode_victim(self, seq: SequenceState, scheduled: list[SequenceState]) -> SequenceState:
        """The sequence to preempt when ``seq`` needs a block none is free for: the newest
        not yet scheduled this step of the request holding the most sequences (``seq``
        itself when that is its own request and none of its others is left)."""
        counts = Counter(s.request_id for s in (*self.running, *scheduled, seq))
        for request_id, _ in counts.most_common():
            for other in reversed(self.running):
                if other.request_id == request_id:
                    return other
            if request_id == seq.request_id:
                return seq
        return seq

    def _fits(self, seq: SequenceState, slots: int) -> bool:
        return len(self.running) + slots <= self.max_num_seqs and self.block_manager.can_allocate(
            seq, slots - 1
        )

    def _preempt_for(self, newcomer: SequenceState, slots: int) -> bool:
        """Make room for ``newcomer`` (``slots`` sequences) from the request holding the most
        running sequences beyond its fair share; True if any was preempted."""
        counts = Counter(s.request_id for s in self.running)
        if not counts or newcomer.request_id in counts:
            return False  # it has its share running already
        fair = max(1, self.max_num_seqs // (len(counts) + 1))
        victim, held = counts.most_common(1)[0]
        if len(self.running) - max(0, held - fair) + slots > self.max_num_seqs:
            return False  # even its whole excess would not make room: preempt nothing
        preempted = False
        for seq in reversed(list(self.running)):
            if held <= fair or self._fits(newcomer, slots):
                break
            if seq.request_id != victim:
                continue
            self.running.remove(seq)
            self._release(seq)
            self.waiting.append(seq)  # behind the newcomer: it is the one waiting its turn
            held -= 1
            preempted = True
        return preempted

    def _release(self, seq: SequenceState) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        seq.rewind()
        self.num_preemptions += 1

    def preempt(self, seq: SequenceState) -> None:
        """Free ``seq``'s blocks and put it first in line; its next prefill recomputes them
        (``SequenceState.rewind``: step by step where the numbers, not only the tokens, matter)."""
        self._release(seq)
        self.waiting.appendleft(seq)

    def preempt_all(self) -> int:
        """Preempt every running sequence, keeping their order; returns how many."""
        count = len(self.running)
        while self.running:
            self.preempt(self.running.pop())
        return count

    def finish(self, seq: SequenceState) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        self.running.remove(seq)

    def add_running(self, seq: SequenceState) -> None:
        """A sequence that holds its blocks already (a fork) joins the running ones."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove_sequence(self, seq: SequenceState) -> bool:
        """Take ``seq`` out of the queues (abort), freeing its blocks; False if not there."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
                return True
        return False

    def remove_all(self) -> list[SequenceState]:
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        return seqs
