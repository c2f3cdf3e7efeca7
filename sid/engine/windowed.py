"""The windowed canonical lane (DESIGN 3.4-3.5): where deterministic rows cannot ride.

Without GEMMs proven to keep a row's bits at every row count (or when a windowed strategy is
asked for), a deterministic request's committed positions are computed as rows of
*canonical passes* of a few checked sizes (``PassSizes``, from ``M_canon`` up; a pass is
padded to the smallest size that holds it). Some rows *must* be canonical: prompt
positions, recomputation after preemption, and verification of a full window of proposals.
A request in its decode phase is flexible: it can speculate in the fast lane, or decode
(verifying any proposals it holds) directly in a canonical pass. A cost model picks, per
step, among speculating, decoding directly, and running the whole step canonically (other
requests' prompt chunks stay in a fast pass when that is cheaper); when it picks
speculating, requests whose rows fit in the padding of a canonical pass that runs anyway
decode directly there. On a GPU the pass costs are timed at start-up
(``sid.engine.calibrate``). ``verify`` commits what a canonical pass confirmed, or rolls a
request back to it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sid.engine.kv_cache import KVCacheManager
from sid.engine.plan import Demand, PassSizes, ScheduledChunk, SchedulerStats, StepPlan
from sid.engine.request import Request
from sid.outputs import PositionLogprobs
from sid.runtime.model_runner import SampledToken


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


class WindowedLane:
    """Plans a step's canonical passes: which flexible requests speculate, decode directly
    or run in a whole canonical step, and how canonical rows pack into passes."""

    def __init__(
        self,
        canonical: PassSizes,
        verify_window: int,
        strategy: str,
        cost_model: PassCost,
        stats: SchedulerStats,
        max_canonical_rows: int | None = None,
    ) -> None:
        self.canonical = canonical
        self.verify_window = verify_window
        self.strategy = strategy
        self.cost_model = cost_model
        self.stats = stats
        self.max_canonical_rows = max_canonical_rows
        """Largest canonical pass to pack (None: the largest size); the sizes may go beyond it
        where every pass carrying deterministic rows needs one."""
        self.graph_rows = 0
        """Largest canonical pass a CUDA graph replays (0: none); the engine sets it."""
        self.fast_graph_rows = 0
        """Largest fast decode step (one row per request) a CUDA graph replays; the engine sets it."""

    def must_verify(self, request: Request) -> bool:
        """The window is full, or a proposal would end generation (a stop token, or the last
        token allowed). Proposals still in flight are placeholders and cannot be checked yet."""
        unverified = request.num_unverified
        if unverified >= self.verify_window or (unverified > 0 and request.num_output_tokens >= request.max_tokens):
            return True
        stops = request.stop_token_set
        return unverified > 0 and any(t in stops for t in request.token_ids[request.n_canon + 1 :])

    def demand(self, request: Request, budget: int) -> Demand | None:
        """What a deterministic request wants: its canonical chunk, and a speculative row when
        it may still choose; None when its canonical prefix covers every token it holds."""
        if request.n_canon >= request.num_tokens:
            return None
        canonical = ScheduledChunk(request, request.n_canon, min(request.num_tokens - request.n_canon, budget))
        if request.needs_canonical_rows or self.must_verify(request):
            return Demand(canonical=canonical, required=True)
        return Demand(canonical=canonical, fast=ScheduledChunk(request, request.num_tokens - 1, 1))

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

    def assign(self, plan: StepPlan, demands: list[Demand]) -> None:
        fast = [d.fast for d in demands if d.canonical is None and d.fast is not None]
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
        plan.canonical = self.pack(canonical)

    def _riders(self, room: int, flexible: list[Demand]) -> list[Demand]:
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

    def pack(self, chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
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


@dataclass
class DeterminismStats:
    deterministic_requests: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    rollbacks: int = 0
    recomputed_tokens: int = 0
    """Proposals thrown away on rollback: fast-lane work the canonical lane redid."""


def verify(
    request: Request,
    end: int,
    samples: list[SampledToken],
    kv: KVCacheManager,
    stats: DeterminismStats,
    emit: Callable[[Request, PositionLogprobs | None], None],
) -> int:
    """Compare canonical tokens with what the request holds; commit, or roll back (DESIGN 3.4).

    ``samples`` come from the chunk's rows up to ``end`` that choose a token (a large pass
    leaves out prompt rows before the last). Returns how many leading positions now have
    canonical K/V that belongs to committed tokens."""
    verified = False
    for sampled in samples:
        nxt = sampled.position + 1
        if nxt < request.num_committed_tokens:
            if nxt >= request.num_prompt_tokens and request.token_ids[nxt] != sampled.token_id:
                raise RuntimeError(
                    f"{request.request_id}: canonical recompute of position {sampled.position} disagrees with "
                    "its committed token; the numerics contract is broken"
                )
            continue
        if request.max_tokens == 0:
            return nxt
        held = request.token_ids[nxt]
        rollback = held >= 0 and held != sampled.token_id
        if held >= 0 and not verified:
            verified = True
            stats.verifications += 1
        if rollback:
            stats.rollbacks += 1
            stats.recomputed_tokens += sum(t >= 0 for t in request.token_ids[nxt:])  # not in-flight ones
            del request.token_ids[nxt + 1 :]
            request.token_ids[nxt] = sampled.token_id
            kv.truncate(request, nxt)  # later rows of this pass read the wrong tokens
            request.n_canon = nxt
            request.epoch += 1  # passes launched since read the wrong tokens too
        elif held < 0:
            request.fill(nxt, sampled.token_id)
        else:
            stats.accepted_tokens += 1
        emit(request, sampled.logprobs)
        if rollback or request.finished:
            return nxt
    return end
