"""GEMM paths, and the start-up proof of which ones give a row the same bits at every row count.

A deterministic request's rows can share a pass with normal rows only if every GEMM gives a
row the same bits whatever the number of rows M (DESIGN 1b): then a row's result does not
depend on how many rows share its pass. Which implementation does that is a fact of the
machine and the weight shape, so the engine proves it at start-up on the model's own weights,
per shape, at every pass size it will use (``prove``), and the fingerprint records the paths.

* ``cublaslt``: torch's cuBLASLt, the fast lane's GEMMs on a GPU. On the H200 it kept a row's
  bits at every M for 16 of 26 shapes measured (DESIGN 1b); below 128 rows the others change.
* ``cublas``: torch's default cuBLAS path with no split-K workspace: all 26 shapes kept their
  bits at every M from 1 to 4,096. Torch reads the workspace size from
  ``CUBLAS_WORKSPACE_CONFIG``; this module sets it to ``:0:0`` before any GEMM runs, and gives
  cuBLASLt a workspace of its own (``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``), unless the
  environment already says otherwise. That workspace keeps torch's default size for
  cuBLASLt (``CUBLASLT_WORKSPACE_SIZE``, 1 MiB), which the shared one capped it to before, so
  the fast lane's cuBLASLt picks the kernels it picked without Sid.
* ``cpu``: torch's CPU GEMM. Float32 changes a row's bits from 4 rows on; bf16 kept them for
  most shapes but not all (the trained test model's down projection changes at 33-333 rows).
* ``cpu:max32``: the rows in GEMMs of at most ``max_rows`` rows each, none padded, where the
  library keeps a row's bits at every row count up to that (the trained test model's down
  projection, 1-32 rows). A decode pass of up to 32 rows runs the fast path's one GEMM, and a
  larger pass takes half the calls of the tiled path, none of them padded.
* ``tiled``: the rows in GEMMs of exactly ``tile`` rows each, the last one padded. At a fixed
  row count a row's bits depend neither on its slot nor on its neighbours (DESIGN 1), so the
  rows keep their bits at every pass size; the price is padding small passes to ``tile``.

Per shape the first candidate that proves invariant is taken: a fixed order, never a timing,
so a machine always makes the same choice and its fingerprint stays put. Passes that hold no
deterministic row keep the fast lane's paths, so normal traffic runs the GEMMs it would run
without determinism.

The fast lane's bits are free, so on a GPU it may take, per shape and small row count, the
quicker of the two libraries (``Gemms.quick``, timed at start-up on the model's weights,
``quick_tables``): cuBLAS without a split-K workspace beats cuBLASLt on some shapes at a few
rows. A canonical pass on the fast path (where no path proves invariant) keeps ``fast`` at
every row count: the fingerprint names it.

A proven path may be slow at a few rows where the fast one is not (on the H200, cuBLAS without
a workspace took 22.7 us for one row of Qwen3-0.6B's down projection and 15.9 us for 8, where
cuBLASLt took 16.0 for either, each a graph of one GEMM). Since its rows keep their bits at
every row count, such a GEMM may run padded to a cheaper row count (``Gemms.padding``, timed at
start-up, ``padding_tables``): a speed choice that changes no bits, so no fingerprint records
it. Each small row count gets its own choice, timed as a pass runs it, the padding's own copy
included, in graphs that run it over the layers' weights in turn. Until 2026-12-06 one floor
per shape served every row count, chosen for their sum from one GEMM a graph, where the graph's
launch outweighs the kernels. That day a decode step of deterministic rows took 8 / 5 / 1 %
longer than a normal one at batch 1 / 8 / 32 on an H200 for Qwen3-0.6B, and for Llama-3.1-8B
3 % longer at batch 1 but 2 % shorter at batch 8, as a floor that suits 8 rows and not 1 would;
on an H100, where no floor was chosen (no pad copy among the step's kernels), Qwen's took 1 %
less at batch 1 and 8. The H200's floors were not recorded, so they are the suspect, not the
proven cause.

A pass that holds deterministic rows among normal ones runs a shape whose proven path is
*bounded* (calls of a bounded row count, the CPU's) row-selectively (``RowSplit``): only the
deterministic rows take the proven path, the others the fast path in one call, so a long
prompt beside one deterministic decode row does not run in tiles. A proven path of one call
(cuBLAS) runs every row of such a pass, as it does where the proven path is the fast one: the
split's two calls and row gathers cost more than they save (H200, one layer's four GEMMs,
eager, 4,096 rows of which 10 % deterministic: Qwen3-0.6B split 1,381 us, every row on the
proven path 390, the fast path alone 644; Llama-3.1-8B 3,134 / 2,618 / 2,488; 2026-12-04).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sid.runtime.faults import FAULTS, batch_noise
from sid.runtime.transfer import upload

if TYPE_CHECKING:
    from sid.engine.plan import PassSizes
    from sid.model.decoder import ColumnFamily

for _name, _value in (("CUBLAS_WORKSPACE_CONFIG", ":0:0"), ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")):
    os.environ.setdefault(_name, _value)

CPU_TILE = 16
"""Rows per GEMM call of the CPU's tiled path: small passes pad to it, large ones loop over it."""
CPU_MAX_ROWS = 32
"""Rows per GEMM call at most of the CPU's bounded path (``cpu:max32``), tried before the tiled one."""
SMALL_ROWS = (1, 2, 4, 8, 16, 32, 64)
"""The row counts whose GEMMs start-up times for a choice of path (``quick_tables``) or padding
(``padding_tables``, the first five): decode graphs' batches and a few deterministic rows. A
pass of more rows takes its shape's one path: from 128 rows on, the two paths of a GPU took
about the same time (DESIGN 1b)."""

PROOF_ELEMENTS = 1 << 18
"""Outputs on which ``prove`` compares each row count at least where a GEMM rounds its float32
sums to a narrower dtype: there a change of summation order with the row count shows in few
outputs (a 64x64 bf16 projection on the CPU: 19 of 524,288 differed between calls of 1 and 2
rows, so comparing their one common row passed it, and the self-test then refused). Float32
outputs keep the sums' low bits: the same change altered 70-92 % of them, so one call per
row count tells it."""

Shape = tuple[int, int, bool]
"""A GEMM as the model runs it: (out features, in features, has a bias)."""


@dataclass(frozen=True)
class GemmPath:
    library: str
    """``cublaslt``, ``cublas`` or ``cpu``."""
    tile: int = 0
    """Rows per GEMM call, the last call padded; 0 = all rows in one call."""
    max_rows: int = 0
    """Rows per GEMM call at most, none padded (with ``tile`` 0); 0 = all rows in one call."""

    @property
    def bounded(self) -> bool:
        """Whether a pass runs in calls of a bounded row count (so its rows split, ``RowSplit``)."""
        return bool(self.tile or self.max_rows)

    def __str__(self) -> str:
        if self.tile:
            return f"{self.library}:tile{self.tile}"
        return f"{self.library}:max{self.max_rows}" if self.max_rows else self.library


def fast_path(device: torch.device) -> GemmPath:
    return GemmPath("cublaslt" if device.type == "cuda" else "cpu", FAULTS.fast_gemm_tile)


def candidates(device: torch.device, tile: int, max_rows: int = CPU_MAX_ROWS) -> tuple[GemmPath, ...]:
    """Paths to try for a row-invariant GEMM, in order of preference (the fast one first)."""
    if device.type == "cuda":
        return GemmPath("cublaslt"), GemmPath("cublas")
    return GemmPath("cpu"), GemmPath("cpu", max_rows=max_rows), GemmPath("cpu", tile)


_library: list[str | None] = [None]
"""torch's preferred BLAS library as this module last set it (setting it costs host time)."""


def run(path: GemmPath, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through ``path``."""
    if path.library != "cpu" and _library[0] != path.library:
        torch.backends.cuda.preferred_blas_library(path.library)
        _library[0] = path.library
    rows = x.shape[0]
    if path.max_rows and rows > path.max_rows:
        return torch.cat([F.linear(part, weight, bias) for part in x.split(path.max_rows)])
    if not path.tile:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, -rows % path.tile)) if rows % path.tile else x
    return torch.cat([F.linear(part, weight, bias) for part in padded.split(path.tile)])[:rows]


def run_padded(
    path: GemmPath, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``run`` on ``x`` padded up to ``rows`` (when it has fewer), the padding's outputs
    dropped: on a proven path a row keeps its bits at every proven row count, so padding to
    one changes none. The padding is left unset: a GEMM's output row reads its own input row
    alone, so no zero fill is launched."""
    n = x.shape[0]
    if rows <= n:
        return run(path, x, weight, bias)
    padded = x.new_empty(rows, x.shape[1])  # the padding rows' values reach no other row's output
    padded[:n] = x
    return run(path, padded, weight, bias)[:n]


Rows = slice | torch.Tensor
"""Some rows of a pass: a contiguous range, or their indices (int64, on the pass's device)."""


def _rows(indices: np.ndarray, device: torch.device) -> Rows:
    """``indices`` (ascending) as a slice where they are contiguous: a view, no gather."""
    start = int(indices[0]) if len(indices) else 0
    if not len(indices) or indices[-1] - start + 1 == len(indices):
        return slice(start, start + len(indices))
    return upload(device, [indices], torch.int64)[0]


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: torch.Tensor, rows: Rows, values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


@dataclass(frozen=True)
class RowSplit:
    """A pass's rows split into the canonical ones (deterministic sequences') and the others,
    found once per pass (the runner's ``forward``) and read by every GEMM of it.

    A GEMM whose proven path is bounded runs the canonical rows alone on the proven path and
    the others on the fast path, one call each. The proven call has ``proven_rows``
    rows, a row count the start-up proof covered: a row gets the same bits at every such
    count, so computing only the canonical rows gives them the bits of the whole pass."""

    canonical: Rows
    fast: Rows
    count: int
    """How many rows are canonical (0: the fast path serves every row)."""
    proven_rows: int
    """The proven call's row count (before the shape's ``padding``): a proven size of at least ``count``."""


@dataclass
class Gemms:
    """The GEMM paths of one model, shared by its layers. ``invariant`` maps each shape to its
    proven path (None until proven, or when some shape has none); the runner ``select``s the
    paths of each pass."""

    fast: GemmPath = field(default_factory=lambda: GemmPath("cpu"))
    invariant: dict[Shape, GemmPath] | None = None
    use_invariant: bool = False
    split: RowSplit | None = None
    """With ``use_invariant``: the rows that need the proven paths; None = every row."""
    quick: dict[Shape, dict[int, GemmPath]] = field(default_factory=dict)
    """Per shape, ``{m: path}`` for ``m`` of ``SMALL_ROWS``: the fast lane's GEMM of at most ``m``
    rows (the smallest such ``m``) takes ``path`` instead of ``fast`` (``quick_tables``, GPU); more rows
    than every ``m``, ``fast``. Never in a canonical pass on the fast path, whose path the
    fingerprint names."""
    canonical: bool = False
    """The GEMMs to come are a canonical pass's (``select``)."""
    padding: dict[Shape, dict[int, int]] = field(default_factory=dict)
    """Per shape, ``{m: rows}`` for ``m`` of ``SMALL_ROWS[:5]``: a proven GEMM of at most ``m`` rows
    (the smallest such ``m``) runs padded to ``rows`` where that is more than ``m``; more rows
    than every ``m``, unpadded."""
    sizes: PassSizes | None = None
    """The row counts the proof covered (with ``invariant``)."""
    k_chunks: int | None = None
    """This rank's share of the TP-invariant K-split (``tp_invariant_chunks`` / TP size):
    row-parallel GEMMs of passes with canonical rows run in that many chunks of their inputs,
    summed in a fixed tree (``row_parallel``); None = one GEMM."""
    tp_free: dict[str, str] | None = None
    """With TP-invariant sums whose paths every TP size shares: the paths that fix a canonical
    row's bits, named without the TP size (the column-parallel GEMMs by the whole model's
    shapes, the row-parallel chunks by theirs), for a fingerprint that holds at every TP size."""

    def set_fast(self, device: torch.device, layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """The fast lane's paths on ``device``: ``fast_path``, and on a GPU the ``quick`` table
        timed on the model's ``layers``."""
        self.fast = fast_path(device)
        others = tuple(p for p in candidates(device, CPU_TILE) if p != self.fast and not p.bounded)
        self.quick = quick_tables(layers, self.fast, others) if device.type == "cuda" else {}

    def fast_is_proven(self) -> bool:
        """Whether the fast lane runs every GEMM on its proven path, so that rows which need
        the proven paths may share the fast lane's graphs."""
        return not self.quick and all(p == self.fast for p in (self.invariant or {}).values())

    def select(self, invariant: bool, split: RowSplit | None = None, canonical: bool = False) -> None:
        """The paths of the GEMMs to come: the fast ones, or (``invariant``) the proven ones
        for the rows of ``split`` (every row when None, or on a one-call proven path) and the
        fast ones for the rest. A ``canonical`` pass on the fast path keeps ``fast`` at every
        row count."""
        self.use_invariant, self.split, self.canonical = invariant, split, canonical

    def split_of(self, flags: np.ndarray, device: torch.device) -> RowSplit | None:
        """The split of a pass's rows into those whose boolean ``flags`` say canonical and the
        others; None when every GEMM runs them all in one call: every row is canonical, or
        some are and no proven path is bounded (a GPU's), so no row index is uploaded."""
        if flags.all() or (flags.any() and not any(p.bounded for p in (self.invariant or {}).values())):
            return None
        assert self.sizes is not None, "a pass split its rows before any GEMM was proven"
        canonical = np.flatnonzero(flags)
        count = len(canonical)
        fast = _rows(np.flatnonzero(~flags), device)
        return RowSplit(_rows(canonical, device), fast, count, self.sizes.fit(count) if count else 0)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.use_invariant:
            return self._fast(x, weight, bias)
        assert self.invariant is not None, "a pass asked for invariant GEMMs before any were proven"
        shape, split = shape_of(weight, bias), self.split
        path = self.invariant[shape]
        if split is None or path == self.fast or (split.count and not path.bounded):
            return self._proven(shape, x, weight, bias)
        if not split.count:
            return self._fast(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        _put(out, split.fast, self._fast(_take(x, split.fast), weight, bias))
        _put(out, split.canonical, self._proven(shape, _take(x, split.canonical), weight, bias, split.proven_rows))
        return out

    def _fast(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        path, n = self.fast, x.shape[0]
        if self.quick and n <= SMALL_ROWS[-1] and not self.canonical:
            path = self.quick.get(shape_of(weight, bias), {}).get(_small_key(n), path)
        out = run(path, x, weight, bias)
        return out + batch_noise(out, FAULTS.fast_gemm_noise) if FAULTS.fast_gemm_noise else out

    def _proven(
        self, shape: Shape, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 0
    ) -> torch.Tensor:
        """``x`` through the proven path of ``shape``, padded to ``rows`` and as ``padding`` says."""
        return run_padded(self.invariant[shape], x, weight, bias, max(rows, self.padded_rows(shape, x.shape[0])))

    def padded_rows(self, shape: Shape, n: int) -> int:
        """How many rows a proven GEMM of ``shape`` on ``n`` rows runs (``padding``)."""
        m = _small_key(n)
        rows = self.padding.get(shape, {}).get(m, m)
        return rows if rows > m else n

    def row_parallel(self, x: torch.Tensor, layer: Linear, canonical: bool) -> torch.Tensor:
        """A row-parallel layer's partial sum on this rank. With ``k_chunks`` a pass with
        canonical rows computes each chunk of K by itself (contiguous inputs and weights, so
        every TP size runs the same GEMMs) and adds them in a balanced tree: at TP size t each
        rank holds ``k_chunks`` = C / t whole chunks, a subtree of the same tree of C leaves,
        so the ranks' sums, added as a tree over the ranks, give the bits of one rank
        computing all C. Each chunk's GEMM follows the pass's ``split`` like any other: the
        canonical rows sum proven chunks, the others fast ones in the same tree (their bits
        are free, and one K-split of all rows keeps a single tree sum and collective)."""
        if not canonical or self.k_chunks is None:
            return layer(x)
        parts = x.chunk(self.k_chunks, -1)
        return tree_sum([self.linear(part.contiguous(), w) for part, w in zip(parts, layer.chunks)])

    def describe(self) -> dict[str, str]:
        """The proven paths by shape, for the fingerprint and the stats."""
        return {_name(s): str(p) for s, p in sorted((self.invariant or {}).items())}

    def describe_choices(self) -> dict[str, dict[str, dict[int, int | str]]]:
        """What start-up timed for speed, by shape, for the stats: the fast lane's ``quick``
        paths and the proven GEMMs' ``padding`` (row counts that take neither are left out)."""
        quick, padding = sorted(self.quick.items()), sorted(self.padding.items())
        return {
            "gemm_fast": {_name(s): {m: str(p) for m, p in t.items() if p != self.fast} for s, t in quick},
            "gemm_padding": {_name(s): {m: r for m, r in t.items() if r > m} for s, t in padding},
        }


def _small_key(n: int) -> int:
    """The key of ``n`` rows in a table by ``SMALL_ROWS`` (``quick``, ``padding``): the smallest
    power of two at or above ``n``, which no table holds above ``SMALL_ROWS[-1]``."""
    return 1 << (n - 1).bit_length()


def _name(shape: Shape) -> str:
    o, i, b = shape
    return f"{o}x{i}{'+bias' if b else ''}"


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (a power of two of them) added pairwise, level by level: a fixed order."""
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]


class Linear(nn.Linear):
    """``nn.Linear`` whose GEMM takes the path its model's ``Gemms`` gives for the pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool, gemms: Gemms) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemms = gemms
        self.chunks: list[torch.Tensor] = []
        """A row-parallel layer's weight split along K for TP-invariant sums (``split``)."""

    def split(self, chunks: int) -> None:
        """Keep the weight also as ``chunks`` contiguous chunks of its input features."""
        assert self.in_features % chunks == 0 and self.bias is None
        self.chunks = [w.contiguous() for w in self.weight.chunk(chunks, -1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemms.linear(x, self.weight, self.bias)


def shape_of(weight: torch.Tensor, bias: torch.Tensor | None) -> Shape:
    return weight.shape[0], weight.shape[1], bias is not None


def prove(path: GemmPath, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Iterable[int]) -> str | None:
    """None if ``path`` gives every row the same bits at every size of ``sizes`` and in
    shuffled slots; otherwise what broke. Each size is compared with the next one on their
    common rows (so all agree), smallest first, so a path that fails is told quickly. A tiled
    path runs every GEMM at one row count, so a few sizes around its tile stand for all; a
    bounded one at every count up to its bound, so those and a few above it stand for all.

    Below float32, every size is then compared again on at least ``PROOF_ELEMENTS`` outputs,
    its calls repeated over further rows where one call has fewer (``_rows_at``): a size of a
    few rows compared on those rows alone would pass a path whose bits change in few outputs."""
    if FAULTS.no_invariant_gemms:
        return "no path is invariant (fault injected)"
    sizes = sorted(set(sizes))
    if path.tile:
        tile = path.tile
        sizes = sorted({m for m in (1, tile - 1, tile, tile + 1, 2 * tile + 3, 4 * tile) if 1 <= m <= sizes[-1]})
    elif path.max_rows:
        most = path.max_rows
        sizes = sorted({m for m in (*range(1, most + 2), 2 * most + 3, 4 * most) if m <= sizes[-1]})
    compared = -(-PROOF_ELEMENTS // weight.shape[0]) if torch.finfo(weight.dtype).bits < 32 else 1  # rows
    rows = max(-(-compared // m) * m for m in sizes)
    gen = torch.Generator(device=weight.device).manual_seed(sizes[-1])
    x = torch.randn(rows, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
    with torch.inference_mode():
        for cover in sorted({1, compared}):  # one call per size first: a path that changes many bits fails quickly
            smaller = _rows_at(path, x, sizes[0], cover, weight, bias)
            for previous, m in pairwise(sizes):
                out = _rows_at(path, x, m, cover, weight, bias)
                common = min(len(out), len(smaller))
                if not torch.equal(out[:common], smaller[:common]):
                    return f"a row changes bits between {previous} and {m} rows"
                smaller = out
        perm = torch.randperm(sizes[-1], generator=gen, device=weight.device)
        if not torch.equal(run(path, x[perm], weight, bias), smaller[perm]):
            return "a row changes with its slot"
    return None


def prove_columns(
    path: GemmPath, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, shards: Iterable[torch.Tensor],
    sizes: Iterable[int],
) -> str | None:
    """None if ``path`` proves row-invariant (``prove``) on every shard of ``weight``'s rows
    and gives each of the first ``rows`` columns the same bits in a call on any shard's rows
    (indices into ``weight``) as in one call on all ``rows``; otherwise what broke. Columns of
    a shard from ``rows`` on (a vocabulary shard's padding) are not compared. The columns are
    compared at one proven row count: with rows invariant at every proven count, that holds
    them at all of them."""
    shards = [idx.to(weight.device) for idx in shards]

    def rows_of(idx: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        return weight[idx], None if bias is None else bias[idx]

    for n in sorted({len(idx) for idx in shards}):  # one proof a shard shape
        idx = next(i for i in shards if len(i) == n)
        broken = prove(path, *rows_of(idx), sizes)
        if broken is not None:
            return f"at {n} of {rows} columns: {broken}"
    m = max(sizes)
    narrowest = min(len(idx) for idx in shards)
    calls = -(-PROOF_ELEMENTS // (m * narrowest)) if torch.finfo(weight.dtype).bits < 32 else 1
    gen = torch.Generator(device=weight.device).manual_seed(rows)
    with torch.inference_mode():
        for _ in range(calls):
            x = torch.randn(m, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
            whole = run(path, x, *rows_of(slice(rows)))
            for idx in shards:
                out = run(path, x, *rows_of(idx))
                kept = idx < rows
                if not torch.equal(out[:, kept], whole[:, idx[kept]]):
                    return f"a column changes bits between calls of {rows} and {len(idx)} columns"
    return None


@dataclass
class FamilyPlan:
    """The column-parallel GEMMs' paths where one path serves every TP size (``prove_families``)."""

    shapes: dict[Shape, GemmPath]
    """This rank's shard shapes and their paths (empty: no path serves every TP size)."""
    names: dict[str, str]
    """The same paths by the whole model's GEMM, named without a TP size (the fingerprint's)."""
    failures: dict[str, str]


def prove_families(
    families: list[ColumnFamily], paths: tuple[GemmPath, ...], sizes: list[int], dtype: torch.dtype,
    device: torch.device, tp_size: int,
) -> FamilyPlan:
    """Per column-parallel GEMM of the model, the first path of ``paths`` that gives its
    columns the same bits in every rank's shard at every TP size (``prove_columns``, on random
    weights of the whole model's shape). Every TP size then makes the same choice, so a row
    gets the same bits at each. No plan where a GEMM has no such path, or where two share a
    shard shape at ``tp_size`` but not a path."""
    chosen: dict[str, GemmPath] = {}
    failures: dict[str, str] = {}
    for family in families:
        path = _column_path(family, paths, sizes, dtype, device, failures)
        if path is None:
            break
        chosen[family.name] = path
    if device.type == "cuda":  # the whole model's random weights (an LM head: ~1 GB) leave no cached blocks
        torch.cuda.empty_cache()  # for the KV cache's sizing to count as taken
    if len(chosen) < len(families):
        return FamilyPlan({}, {}, failures)
    shapes: dict[Shape, GemmPath] = {}
    for family in families:
        shape = (len(family.shards[tp_size, 0]), family.in_features, family.bias)
        if shapes.setdefault(shape, chosen[family.name]) != chosen[family.name]:
            failures[family.name] = f"shares its shard shape {shape} with a GEMM of another path"
            return FamilyPlan({}, {}, failures)
    names = {f"{f.name} {f.rows}x{f.in_features}{'+bias' if f.bias else ''}": str(chosen[f.name]) for f in families}
    return FamilyPlan(shapes, names, failures)


def _column_path(
    family: ColumnFamily, paths: tuple[GemmPath, ...], sizes: list[int], dtype: torch.dtype, device: torch.device,
    failures: dict[str, str],
) -> GemmPath | None:
    """The first of ``paths`` that ``prove_columns`` accepts for ``family`` on random weights
    of the whole model's shape; why the others failed goes into ``failures``."""
    gen = torch.Generator(device=device).manual_seed(family.rows)
    rows = max(family.rows, *(int(idx.max()) + 1 for idx in family.shards.values()))
    weight = torch.randn(rows, family.in_features, generator=gen, device=device).to(dtype)
    bias = torch.randn(rows, generator=gen, device=device).to(dtype) if family.bias else None
    for path in paths:
        broken = prove_columns(path, weight, bias, family.rows, family.shards.values(), sizes)
        if broken is None:
            return path
        failures[f"{family.name} {path}"] = broken
    return None


def _rows_at(
    path: GemmPath, x: torch.Tensor, m: int, rows: int, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The first rows of ``x`` through ``path`` in calls of ``m`` rows each, as many calls as
    cover ``rows`` rows (one, where ``m`` does)."""
    calls = -(-rows // m)
    return torch.cat([run(path, x[i * m : (i + 1) * m], weight, bias) for i in range(calls)])


def time_gemm(
    path: GemmPath, x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int = 0,
    iters: int = 20, calls: int = 16,
) -> float:
    """Median microseconds of one GEMM of ``x``'s rows through ``path`` (padded to ``rows`` as
    ``run_padded`` pads), from a CUDA graph that runs it on each of ``layers`` (weight, bias; one
    shape) in turn, at least ``calls`` GEMMs in all: what is timed is the kernels and not the
    graph's launch, and each weight is read from L2 only as far as a pass leaves it there
    (one weight timed alone would stay in L2 where it fits, as Llama-3.1-8B's 32 MiB o_proj
    fits the H100's 50 MB)."""
    order = [layers[i % len(layers)] for i in range(max(calls, len(layers)))]
    for weight, bias in order[:1]:
        run_padded(path, x, weight, bias, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight, bias in order:
            run_padded(path, x, weight, bias, rows)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(order))
    return statistics.median(times)


PAD_GAIN = 0.95
"""A row count is padded only where that brings its GEMM's time to this share of the unpadded
time or below: padding that timing noise alone favours costs a pad copy for nothing."""

QUICK_GAIN = 0.98
"""The fast lane leaves ``fast`` for another path only where that takes this share of its time
or less: a choice costs nothing as it runs, but one that noise alone made would flip between
two starts of the same machine."""


def _by_shape(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
) -> dict[Shape, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """``layers`` (weight, bias) grouped by shape, CUDA ones only (the choices timed are a GPU's)."""
    shapes: dict[Shape, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in layers:
        if weight.is_cuda:
            shapes.setdefault(shape_of(weight, bias), []).append((weight, bias))
    return shapes


def _small_inputs(weight: torch.Tensor) -> torch.Tensor:
    return torch.randn(SMALL_ROWS[-1], weight.shape[1], device=weight.device).to(weight.dtype)


def quick_tables(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]], fast: GemmPath, others: tuple[GemmPath, ...],
) -> dict[Shape, dict[int, GemmPath]]:
    """Per shape of ``layers`` (weight, bias), the path of each of ``SMALL_ROWS`` in the fast lane
    (``Gemms.quick``): the quickest of ``others`` where it takes ``QUICK_GAIN`` of ``fast``'s time
    or less, else ``fast``, timed on the model's weights. On an H100, Llama-3.1-8B's o_proj and
    down projection at batch 1 took about 1,700 us a step on cuBLAS without a split-K workspace
    against 1,830 on cuBLASLt, its split-K reduce included (2026-12-06). Shapes where ``fast``
    serves every row count are left out."""
    tables: dict[Shape, dict[int, GemmPath]] = {}
    for shape, weights in _by_shape(layers).items():
        x = _small_inputs(weights[0][0])
        with torch.inference_mode():
            us = {(p, m): time_gemm(p, x[:m], weights) for p in (fast, *others) for m in SMALL_ROWS}
        table = {}
        for m in SMALL_ROWS:
            best = min(others, key=lambda p, m=m: us[p, m], default=fast)
            table[m] = best if us[best, m] <= QUICK_GAIN * us[fast, m] else fast
        if any(p != fast for p in table.values()):
            tables[shape] = table
    return tables


def padding_tables(
    plan: dict[Shape, GemmPath], layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]], fast: GemmPath,
) -> dict[Shape, dict[int, int]]:
    """Per shape whose proven path is not the fast one (CUDA), what each of 1-16 rows (the
    proven sizes a decode graph or a few deterministic rows run) is padded to (``Gemms.padding``):
    the larger of ``rows`` whose GEMM is quickest, timed on the model's weights as a pass runs
    it (the pad included), where it beats no padding by ``PAD_GAIN``. Shapes that pad no row
    count are left out."""
    rows = SMALL_ROWS[:5]
    tables: dict[Shape, dict[int, int]] = {}
    for shape, weights in _by_shape(layers).items():
        path = plan[shape]
        if path == fast:
            continue
        x = _small_inputs(weights[0][0])
        with torch.inference_mode():
            us = {(m, f): time_gemm(path, x[:m], weights, f) for f in rows for m in rows if m <= f}
        best = {m: min((f for f in rows if f >= m), key=lambda f, m=m: us[m, f]) for m in rows}
        tables[shape] = {m: f if us[m, f] <= PAD_GAIN * us[m, m] else m for m, f in best.items()}
    return {shape: table for shape, table in tables.items() if any(f > m for m, f in table.items())}


def prove_plan(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]], paths: tuple[GemmPath, ...], sizes: list[int],
    decided: dict[Shape, GemmPath] | None = None,
) -> tuple[dict[Shape, GemmPath] | None, dict[str, str]]:
    """The first path of ``paths`` proven for each distinct shape of ``layers`` (weight, bias),
    or None when some shape has none; and, per shape, why the paths before it failed. A shape
    in ``decided`` may take only its path there (proven on these weights too)."""
    plan: dict[Shape, GemmPath] = {}
    failures: dict[str, str] = {}
    for weight, bias in layers:
        shape = shape_of(weight, bias)
        if shape in plan:
            continue
        chosen = (decided or {}).get(shape)
        for path in (chosen,) if chosen else paths:
            broken = prove(path, weight, bias, sizes)
            if broken is None:
                plan[shape] = path
                break
            failures[f"{shape[0]}x{shape[1]} {path}"] = broken
        else:
            return None, failures
    return plan, failures
