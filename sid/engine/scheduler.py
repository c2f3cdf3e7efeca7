"""Continuous batching under a token budget, for both lanes.

Each step, running requests go first (a decode is one token, an unfinished prompt a
chunk), then waiting ones in arrival order, until ``max_num_batched_tokens`` or
``max_num_seqs`` is reached. When the KV pool runs dry the most recently arrived running
request is preempted: its blocks are freed and it waits again at the head of the queue,
keeping its committed tokens, to be recomputed (mostly from the prefix cache) later.

Deterministic requests (DESIGN 2-3) put rows into canonical passes of ``M_canon`` rows,
or of a larger checked size (``PassSizes``) when there are many rows: a pass is padded
to the smallest size that holds it. Some rows *must* be canonical: prompt
positions, recomputation after preemption, and verification of a full window of
proposals. A deterministic request in its decode phase is flexible: it can speculate in
the fast lane, or decode (verifying any proposals it holds) directly in a canonical pass.
A cost model picks, per step, among speculating, decoding directly, and running the whole
step canonically (other requests' prompt chunks stay in a fast pass when that is
cheaper); when it picks speculating, requests whose rows fit in the padding of a canonical
pass that runs anyway decode directly there. On a GPU the pass costs are timed at start-up.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from sid.engine.kv_cache import KVCacheManager
from sid.engine.request import Request, RequestStatus

STRATEGIES = ("auto", "ride", "speculate", "direct", "whole")
WINDOWED = ("speculate", "direct", "whole")
"""The strategies of the canonical lane (DESIGN 3.4-3.5), for where rows cannot ride."""


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` consecutive positions of ``request`` starting at ``start``."""

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
class StepPlan:
    fast: list[ScheduledChunk] = field(default_factory=list)
    canonical: list[list[ScheduledChunk]] = field(default_factory=list)  # one list per pass
    preempted: list[Request] = field(default_factory=list)
    strategy: str | None = None  # how flexible deterministic decodes ran, if there were any

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.fast + [c for p in self.canonical for c in p]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class PassSizes:
    """The row counts a canonical pass may have, ascending; the first is ``M_canon``.

    A row gets the same bits at every size (the start-up self-test checks each one against
    ``M_canon``, DESIGN 3.7), so the size of a pass is free to follow the load: prompts run
    in few large passes, verification in small ones, and a whole step in a pass about its
    own size. ``grid`` spaces the sizes ``per_octave`` to each doubling, so padding a pass
    to the next size wastes at most ``1 / per_octave`` of it.
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"canonical pass sizes must be distinct, ascending and positive, got {self.sizes}")

    @classmethod
    def grid(cls, base: int, largest: int, per_octave: int = 1, cover: bool = False) -> PassSizes:
        """``base * 2**j * (1 + k / per_octave)`` for ``k < per_octave`` (every integer where an
        octave has fewer), up to ``largest``, or up to the first size at or above it (``cover``:
        every pass of up to ``largest`` rows then has a size that holds it)."""
        if base < 1 or largest < base:
            raise ValueError(
                f"canonical pass sizes need 1 <= canonical_rows <= max_canonical_rows, got {base} and {largest}"
            )
        if per_octave < 1:
            raise ValueError(f"canonical_sizes_per_octave must be >= 1, got {per_octave}")
        sizes: list[int] = []
        octave = base
        while True:
            for size in range(octave, 2 * octave, max(1, octave // per_octave)):
                if size > largest and not (cover and sizes[-1] < largest):
                    return cls(tuple(sizes))
                sizes.append(size)
            octave *= 2

    @property
    def base(self) -> int:
        return self.sizes[0]

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def fit(self, rows: int) -> int:
        """The smallest size that holds ``rows`` rows."""
        i = bisect_left(self.sizes, rows)
        if i < len(self.sizes):
            return self.sizes[i]
        raise RuntimeError(f"a canonical pass of {rows} rows exceeds the largest size, {self.max}")


class PassCost(Protocol):
    """Time of one forward pass, in a unit of the model's own choosing: the scheduler only
    compares sums of these. ``graphed``: a CUDA graph replays the pass (no launch gaps)."""

    def fast(self, rows: int, graphed: bool) -> float: ...

    def canonical(self, size: int, graphed: bool) -> float: ...


@dataclass(frozen=True)
class PassCostModel:
    """``max(1, rows / knee)``, times ``canonical_factor`` for a canonical pass (its
    attention schedule): a pass is bound by reading the weights until the GEMMs turn
    compute-bound near ``knee`` rows. On a CPU rows cost about linearly beyond a few; on a
    GPU the engine replaces this with passes it timed at start-up (``MeasuredPassCost``),
    since what a pass costs there depends on the model (a small one is bound by launching
    its kernels, which a CUDA graph avoids, a large one by its weights)."""

    knee: int
    canonical_factor: float = 1.05

    def fast(self, rows: int, graphed: bool = False) -> float:
        return max(1.0, rows / self.knee) if rows else 0.0

    def canonical(self, size: int, graphed: bool = False) -> float:
        return self.fast(size) * self.canonical_factor


@dataclass(frozen=True)
class MeasuredPassCost:
    """Wall milliseconds of passes timed at start-up (``sid.engine.calibrate``), as
    ``(rows, ms)`` points per lane and launch mode, interpolated linearly between points and
    extrapolated along the last segment. A mode with no points (nothing graphed) is never asked."""

    fast_graphed: tuple[tuple[int, float], ...] = ()
    fast_eager: tuple[tuple[int, float], ...] = ()
    canonical_graphed: tuple[tuple[int, float], ...] = ()
    canonical_eager: tuple[tuple[int, float], ...] = ()

    def fast(self, rows: int, graphed: bool) -> float:
        return _interpolate(self.fast_graphed if graphed else self.fast_eager, rows) if rows else 0.0

    def canonical(self, size: int, graphed: bool) -> float:
        return _interpolate(self.canonical_graphed if graphed else self.canonical_eager, size)


def _interpolate(points: tuple[tuple[int, float], ...], rows: int) -> float:
    if not points:
        raise ValueError("no pass of this kind was timed")
    if len(points) == 1 or rows <= points[0][0]:
        return points[0][1]
    i = min(max(bisect_left([r for r, _ in points], rows), 1), len(points) - 1)
    (r0, t0), (r1, t1) = points[i - 1], points[i]
    return max(0.0, t0 + (t1 - t0) * (rows - r0) / (r1 - r0))


GPU_COST = PassCostModel(knee=192)
CPU_COST = PassCostModel(knee=8)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    canonical_passes: int = 0
    canonical_rows_used: int = 0
    canonical_rows_padded: int = 0
    strategy_choices: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STRATEGIES[1:]})


@dataclass
class _Demand:
    """What one request wants this step: its canonical chunk, and a speculative one if flexible."""

    canonical: ScheduledChunk | None = None
    fast: ScheduledChunk | None = None
    required: bool = False

    @property
    def upto(self) -> int:
        """Positions that need cache slots, whichever lane the request ends up in."""
        canonical, fast = self.canonical, self.fast
        if canonical is None or fast is None:
            return (canonical or fast).end  # type: ignore[union-attr]
        return max(canonical.end, fast.end)

    @property
    def rows(self) -> int:
        """Token budget taken: the larger of the two alternatives."""
        canonical, fast = self.canonical, self.fast
        if canonical is None or fast is None:
            return (canonical or fast).num_tokens  # type: ignore[union-attr]
        return max(canonical.num_tokens, fast.num_tokens)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        canonical: PassSizes,
        verify_window: int,
        strategy: str = "auto",
        cost_model: PassCost = CPU_COST,
        max_canonical_rows: int | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown determinism strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.canonical = canonical
        self.max_canonical_rows = max_canonical_rows
        """Largest canonical pass the windowed lane packs (None: the largest size); the sizes
        may go beyond it where every pass carrying deterministic rows needs one."""
        self.verify_window = verify_window
        self.strategy = strategy
        self.cost_model = cost_model
        self.graph_rows = 0
        """Largest canonical pass a CUDA graph replays (0: none); the engine sets it."""
        self.fast_graph_rows = 0
        """Largest fast decode step (one row per request) a CUDA graph replays; the engine sets it."""
        self.ride = False
        """Deterministic requests are scheduled as normal ones: their rows ride in fast passes
        (the engine sets it when the GEMMs are proven row-invariant, DESIGN 1b)."""
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

    def must_verify(self, request: Request) -> bool:
        """The window is full, or a proposal would end generation (a stop token, or the last
        token allowed). Proposals still in flight are placeholders and cannot be checked yet."""
        unverified = request.num_unverified
        if unverified >= self.verify_window or (unverified > 0 and request.num_output_tokens >= request.max_tokens):
            return True
        stops = request.stop_token_set
        return unverified > 0 and any(t in stops for t in request.token_ids[request.n_canon + 1 :])

    def _demand(self, request: Request, budget: int) -> _Demand | None:
        """None when nothing is left to compute: the pass that ends the request is launched,
        and its results are not in yet (overlapped scheduling)."""
        if request.last_token_in_flight:
            return None
        if not request.deterministic or self.ride:
            start = request.num_computed_tokens
            if start >= request.num_tokens:
                return None
            return _Demand(fast=ScheduledChunk(request, start, min(request.num_tokens - start, budget)))
        if request.n_canon >= request.num_tokens:
            return None
        canonical = ScheduledChunk(request, request.n_canon, min(request.num_tokens - request.n_canon, budget))
        if request.needs_canonical_rows or self.must_verify(request):
            return _Demand(canonical=canonical, required=True)
        fast = ScheduledChunk(request, request.num_tokens - 1, 1)
        return _Demand(canonical=canonical, fast=fast)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        demands: list[_Demand] = []
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

    @property
    def largest_pass(self) -> int:
        cap = self.max_canonical_rows or self.canonical.max
        return max((s for s in self.canonical.sizes if s <= cap), default=self.canonical.base)

    def _pass_sizes(self, rows: int) -> list[int]:
        """Sizes of the passes ``_pack`` makes for ``rows`` rows: full largest ones, then the
        smallest size that holds the rest."""
        largest = self.largest_pass
        full, rest = divmod(rows, largest)
        return [largest] * full + ([self.canonical.fit(rest)] if rest else [])

    def _padding(self, rows: int) -> int:
        """Padding rows of the passes ``_pack`` makes for ``rows`` rows."""
        return sum(self._pass_sizes(rows)) - rows

    def _passes_cost(self, rows: int) -> float:
        return sum(self.cost_model.canonical(size, size <= self.graph_rows) for size in self._pass_sizes(rows))

    def _fast_cost(self, rows: int, prompt_rows: int) -> float:
        """A fast pass of ``rows`` rows, ``prompt_rows`` of them in prompt chunks (which rule
        out a decode graph)."""
        return self.cost_model.fast(rows, not prompt_rows and rows <= self.fast_graph_rows)

    def _whole(self, fast_rows: int, fast_prompt_rows: int, canonical_rows: int) -> tuple[float, bool]:
        """Cost of a whole step, and whether it leaves the fast lane's prompt chunks in a fast
        pass rather than running everything canonically: those requests did not ask for
        determinism and the fast lane's prefill attention is quicker, but a pass more costs
        a launch-bound model a whole pass."""
        everything = self._passes_cost(fast_rows + canonical_rows)
        if not fast_prompt_rows:
            return everything, False
        moved = fast_rows - fast_prompt_rows + canonical_rows
        kept = self._fast_cost(fast_prompt_rows, fast_prompt_rows) + self._passes_cost(moved)
        return (kept, True) if kept < everything else (everything, False)

    def choose_strategy(
        self, fast_rows: int, required_rows: int, num_flexible: int, flexible_rows: int, fast_prompt_rows: int = 0
    ) -> str:
        """Cheapest way to run this step's flexible deterministic decodes (DESIGN 3.5).

        Speculating costs a fast row now and, later, a share of the pass that verifies the
        window: ``num_flexible`` windows of ``W + 1`` rows every ``W`` steps. ``fast_prompt_rows``
        of the ``fast_rows`` are other requests' prompt chunks, which a whole step may keep
        in a fast pass (``_whole``)."""
        if self.strategy != "auto":
            return self.strategy
        w = self.verify_window
        canonical_rows = required_rows + flexible_rows
        costs = {
            "whole": self._whole(fast_rows, fast_prompt_rows, canonical_rows)[0],
            "direct": self._fast_cost(fast_rows, fast_prompt_rows) + self._passes_cost(canonical_rows),
            "speculate": self._fast_cost(fast_rows + num_flexible, fast_prompt_rows)
            + self._passes_cost(required_rows)
            + self._passes_cost(num_flexible * (w + 1)) / w,
        }
        return min(costs, key=costs.__getitem__)

    def _assign_lanes(self, plan: StepPlan, demands: list[_Demand]) -> None:
        fast = [d.fast for d in demands if d.canonical is None and d.fast is not None]
        if self.ride:
            plan.fast = fast
            if any(c.request.deterministic for c in fast):
                plan.strategy = "ride"
                self.stats.strategy_choices["ride"] += 1
            return
        required = [d.canonical for d in demands if d.required and d.canonical is not None]
        flexible = [d for d in demands if d.canonical is not None and not d.required]
        canonical: list[ScheduledChunk] = list(required)
        if flexible or (required and fast):
            fast_rows = sum(c.num_tokens for c in fast)
            prompt_rows = sum(c.num_tokens for c in fast if c.num_tokens > 1)
            required_rows = sum(c.num_tokens for c in required)
            flexible_rows = sum(d.canonical.num_tokens for d in flexible)  # type: ignore[union-attr]
            strategy = self.choose_strategy(fast_rows, required_rows, len(flexible), flexible_rows, prompt_rows)
            if strategy == "speculate":
                riders = {id(d) for d in self._riders(self._padding(required_rows), flexible)}
                for d in flexible:
                    if id(d) in riders:
                        canonical.append(d.canonical)  # type: ignore[arg-type]
                    else:
                        fast.append(d.fast)  # type: ignore[arg-type]
            else:
                canonical += [d.canonical for d in flexible]  # type: ignore[misc]
            if strategy == "whole":
                # Only a step with other prompts has a choice to make (and to weigh again).
                keep = prompt_rows > 0 and self._whole(fast_rows, prompt_rows, required_rows + flexible_rows)[1]
                moved = [c for c in fast if not keep or c.num_tokens == 1]
                canonical, fast = moved + canonical, [c for c in fast if keep and c.num_tokens > 1]
            if flexible or strategy == "whole":
                plan.strategy = strategy
                self.stats.strategy_choices[strategy] += 1
        plan.fast = fast
        plan.canonical = self._pack(canonical)

    def _riders(self, room: int, flexible: list[_Demand]) -> list[_Demand]:
        """Flexible requests that decode directly in the ``room`` padding rows of this step's
        required canonical passes instead of speculating: free rows, and their windows are
        verified early (which keeps the windows of several requests in step)."""
        riders = []
        for demand in sorted(flexible, key=lambda d: d.canonical.num_tokens):  # type: ignore[union-attr]
            rows = demand.canonical.num_tokens  # type: ignore[union-attr]
            if rows > room:
                break
            riders.append(demand)
            room -= rows
        return riders

    def _pack(self, chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Fill passes of the largest size in order, splitting chunks at pass edges; the
        runner pads the last one to the smallest size that holds it."""
        passes: list[list[ScheduledChunk]] = []
        room = 0
        for chunk in chunks:
            start, end = chunk.start, chunk.end
            while start < end:
                if room == 0:
                    passes.append([])
                    room = self.largest_pass
                n = min(room, end - start)
                passes[-1].append(chunk if n == chunk.num_tokens else ScheduledChunk(chunk.request, start, n))
                start += n
                room -= n
        used = sum(c.num_tokens for c in chunks)
        self.stats.canonical_passes += len(passes)
        self.stats.canonical_rows_used += used
        self.stats.canonical_rows_padded += self._padding(used)
        return passes
