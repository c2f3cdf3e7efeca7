"""What a step runs: chunks of requests, the passes they form, and the sizes a pass carrying
deterministic rows may have. The scheduler makes these, the runner turns them into tensors."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from sid.engine.request import Request

STRATEGIES = ("auto", "ride", "speculate", "direct", "whole")
"""How deterministic requests are served: ``ride`` in ordinary passes (DESIGN 1b), or in
the windowed canonical lane (``speculate``, ``direct``, ``whole``, DESIGN 3.4-3.5);
``auto`` rides where the GEMMs are proven and picks the cheapest windowed strategy each
step elsewhere."""


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
class Demand:
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
