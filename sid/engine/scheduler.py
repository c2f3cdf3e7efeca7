"""Continuous batching under a token budget.

Each step, running requests go first (a decode is one token, an unfinished prompt a
chunk), then waiting ones in arrival order, until ``max_num_batched_tokens`` or
``max_num_seqs`` is reached. When the KV pool runs dry the most recently arrived running
request is preempted: its blocks are freed and it waits again at the head of the queue,
keeping its committed tokens, to be recomputed (mostly from the prefix cache) later.

Deterministic requests are scheduled as normal ones where their rows ride in ordinary
passes (``ride``, DESIGN 1b): the runner gives their rows canonical numerics. Elsewhere the
windowed canonical lane (``sid.engine.windowed``) says what they need and where it runs.
"""

from __future__ import annotations

from collections import deque

from sid.engine.kv_cache import KVCacheManager
from sid.engine.plan import STRATEGIES, Demand, ScheduledChunk, StepPlan
from sid.engine.request import Request, RequestStatus
from sid.engine.windowed import WindowedLane


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, windowed: WindowedLane
    ) -> None:
        if windowed.strategy not in STRATEGIES:
            raise ValueError(f"unknown determinism strategy {windowed.strategy!r}; use one of {', '.join(STRATEGIES)}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.windowed = windowed
        self.stats = windowed.stats
        self.ride = False
        """Deterministic requests are scheduled as normal ones: their rows ride in ordinary
        passes (the engine sets it when the GEMMs are proven row-invariant, DESIGN 1b)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
        """Free a request's blocks; it keeps its committed tokens and drops its proposals."""
        self.running.remove(request)
        self.kv.free(request)
        del request.token_ids[request.num_committed_tokens :]
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.n_canon = 0
        request.num_preemptions += 1
        request.epoch += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _demand(self, request: Request, budget: int) -> Demand | None:
        """None when nothing is left to compute: the pass that ends the request is launched,
        and its results are not in yet (overlapped scheduling)."""
        if request.last_token_in_flight:
            return None
        if request.deterministic and not self.ride:
            return self.windowed.demand(request, budget)
        start = request.num_computed_tokens
        if start >= request.num_tokens:
            return None
        return Demand(fast=ScheduledChunk(request, start, min(request.num_tokens - start, budget)))

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        demands: list[Demand] = []
        planned: set[int] = set()
        preempted: set[int] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if id(request) in preempted:  # preempted below to make room for an earlier one
                continue
            demand = self._demand(request, budget)
            if demand is None:
                continue
            while not self.kv.allocate(request, demand.upto):
                # Requests that end when their in-flight pass lands give their blocks back then.
                victim = next((r for r in reversed(self.running) if not r.last_token_in_flight), request)
                if id(victim) in planned:  # never undo work already planned this step
                    victim = request
                self._preempt(victim)
                plan.preempted.append(victim)
                preempted.add(id(victim))
                if victim is request:
                    break
            else:
                demands.append(demand)
                planned.add(id(request))
                budget -= demand.rows
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            start = len(cached) * self.kv.block_size
            end = min(request.num_tokens, start + budget)
            if not self.kv.allocate(request, end, cached):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = start
            request.num_computed_tokens = start
            request.n_canon = start if request.deterministic else 0
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            demand = self._demand(request, budget)
            assert demand is not None  # a waiting request has its last token left at least
            demands.append(demand)
            budget -= demand.rows
        self._assign_lanes(plan, demands)
        self.stats.steps += 1
        self.stats.scheduled_tokens += plan.num_tokens
        return plan

    def _assign_lanes(self, plan: StepPlan, demands: list[Demand]) -> None:
        """Riding rows join the fast pass; otherwise the windowed lane plans the canonical passes."""
        if not self.ride:
            self.windowed.assign(plan, demands)
            return
        plan.fast = [d.fast for d in demands if d.fast is not None]
        if any(c.request.deterministic for c in plan.fast):
            plan.strategy = "ride"
            self.stats.strategy_choices["ride"] += 1
