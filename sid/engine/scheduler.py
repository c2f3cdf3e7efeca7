"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step, running requests go first (a decode is one token, an unfinished prompt a
chunk), then waiting ones in arrival order, until ``max_num_batched_tokens`` or
``max_num_seqs`` is reached. When the KV pool runs dry the most recently arrived running
request is preempted: its blocks are freed and it waits again at the head of the queue,
keeping its generated tokens, to be recomputed (mostly from the prefix cache) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sid.engine.kv_cache import KVCacheManager
from sid.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start``."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so it yields the next one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give its blocks back."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted below to make room for an earlier one
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, n):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never undo work already planned this step
                    victim = request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                scheduled.add(id(request))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            start = request.num_computed_tokens + len(cached) * self.kv.block_size
            n = min(request.num_tokens - start, budget)
            if not self.kv.allocate(request, n, cached):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = len(cached) * self.kv.block_size
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, start, n))
            budget -= n
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.num_tokens
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """The step ran: its chunks' K/V is in the cache."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens = chunk.end
            self.kv.cache_full_blocks(chunk.request)
