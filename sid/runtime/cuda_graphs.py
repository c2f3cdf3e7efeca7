"""CUDA graphs: the fast lane's decode steps, one per batch-size bucket, and canonical passes.

A decode step or a canonical pass launches a few hundred small kernels; replaying a captured
graph removes the launch gaps. Every graph reads the same static input buffers (a pass's
rows are copied in and padded) and all graphs share one memory pool. Attention inside a
graph is launched for ``max_seq_len`` keys (the model's limit), so its schedule is fixed at
capture; rows with shorter contexts skip the empty tiles. Sampling stays outside the graph.

* A decode graph of bucket ``b`` runs ``b`` one-row sequences; rows past the step's are
  padding that writes nothing. Each sequence attends with the schedule its flag in
  ``canonical_seqs`` says, so one graph serves fast steps and steps where deterministic rows
  ride (DESIGN 1b); when those need other GEMM paths than the fast lane's, each bucket has a
  second graph with the row-invariant GEMMs (``GraphShape.invariant``).
* A canonical graph (DESIGN 3.1, the windowed lane) runs a canonical pass of one size, as the
  eager pass of that size does (larger canonical passes, mostly prompts, run eagerly), over
  one sequence slot more than rows (a pass has at most one sequence per row plus the padding
  sequence); unused slots have no query rows, so the attention kernel skips them. Its
  schedule depends on positions only, so replaying it gives the eager canonical pass's bits
  (tests/test_gpu.py checks this).

Under tensor parallelism every rank captures the same graphs from the same ``GraphSpec``
(the collectives inside them too) and replays the one rank 0's plan names. Off CUDA there
is nothing to capture: ``replay`` computes what the graph would (the CPU tests, gloo).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sid.model.decoder import CausalLM
from sid.runtime.attention import AttentionMetadata, PagedKVCache
from sid.runtime.piecewise_graphs import PieceGraphs
from sid.runtime.transfer import upload

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 below ``max_batch``, and ``max_batch`` itself."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


@dataclass(frozen=True)
class GraphShape:
    """A graph: its query rows and sequence slots, whether it is a canonical pass, and whether
    its GEMMs take their row-invariant paths. Graphs are keyed by their shape."""

    rows: int
    seqs: int
    canonical: bool
    invariant: bool = False


@dataclass(frozen=True)
class GraphSpec:
    """Which graphs an engine captures: ``CUDAGraphs``' settings, and the piece buckets of
    passes with prompt rows (none: those run eagerly) with their GEMM paths. Every rank of
    a tensor-parallel group builds its graphs from rank 0's spec."""

    max_batch: int
    canonical_sizes: tuple[int, ...]
    max_blocks: int
    max_seq_len: int
    riding: bool
    invariant_decode: bool
    canonical_invariant: bool
    piece_buckets: tuple[int, ...]
    pieces_invariant: bool

    def capture(self, model: CausalLM, kv_cache: PagedKVCache) -> tuple[CUDAGraphs, PieceGraphs | None]:
        """Build and capture the graphs over ``model`` and ``kv_cache``."""
        start = time.perf_counter()
        graphs = CUDAGraphs(
            model,
            kv_cache,
            max_batch=self.max_batch,
            canonical_sizes=self.canonical_sizes,
            max_blocks=self.max_blocks,
            max_seq_len=self.max_seq_len,
            riding=self.riding,
            invariant_decode=self.invariant_decode,
            canonical_invariant=self.canonical_invariant,
        )
        graphs.capture()
        pieces = None
        if self.piece_buckets:
            pieces = PieceGraphs(model, kv_cache, self.piece_buckets, invariant=self.pieces_invariant)
            pieces.capture()
        if graphs.captured:
            logger.info(
                "captured %d CUDA graphs and the pieces of %d prompt-pass buckets in %.1f s",
                len(graphs.graphs), len(self.piece_buckets), time.perf_counter() - start,
            )  # fmt: skip
        return graphs, pieces


class CUDAGraphs:
    """The captured graphs over one set of static input buffers: ``load`` (or
    ``load_placeholder``) fills the buffers for a graph's shape, ``replay`` runs it.
    ``riding``: decode steps may carry deterministic rows (else their graphs launch the fast
    attention schedule alone, and under TP sum across ranks as the fast lane does);
    ``invariant_decode``: those steps need graphs of their own (the row-invariant GEMM paths
    differ from the fast ones); ``canonical_invariant``: the canonical graphs take the
    row-invariant paths."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        max_batch: int,
        canonical_sizes: Sequence[int] = (),
        max_blocks: int,
        max_seq_len: int,
        riding: bool = False,
        invariant_decode: bool = False,
        canonical_invariant: bool = False,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.max_seq_len = max_seq_len
        self.riding = riding
        self.buckets = decode_buckets(max_batch)
        self.invariant_decode, self.canonical_invariant = invariant_decode, canonical_invariant
        variants = (False, True) if invariant_decode else (False,)
        self.shapes = [GraphShape(b, b, False, inv) for b in self.buckets for inv in variants]
        self.shapes += [GraphShape(size, size + 1, True, canonical_invariant) for size in canonical_sizes]
        device = kv_cache.k[0].device
        rows = max(s.rows for s in self.shapes)
        seqs = max(s.seqs for s in self.shapes)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((seqs, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.canonical_seqs = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphShape, torch.Tensor] = {}
        self.captured = False

    def canonical_shape(self, rows: int) -> GraphShape:
        return GraphShape(rows, rows + 1, True, self.canonical_invariant)

    def has_canonical(self, rows: int) -> bool:
        return self.canonical_shape(rows) in self.shapes

    def _meta(self, shape: GraphShape) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[: shape.rows],
            block_tables=self.block_tables[: shape.seqs],
            seq_lens=self.seq_lens[: shape.seqs],
            query_start_loc=self.query_start_loc[: shape.seqs + 1],
            max_query_len=shape.rows if shape.canonical else 1,
            max_seq_len=self.max_seq_len,
            canonical=True if shape.canonical else self.canonical_seqs[: shape.seqs],
            # Where deterministic rows have graphs of their own, the others hold fast rows only.
            schedules=(True, self.riding and (shape.invariant or not self.invariant_decode)),
        )

    def forward(self, shape: GraphShape) -> torch.Tensor:
        """The captured computation of graph ``shape``, eagerly: logits of its static rows.
        An invariant graph runs every row on the proven GEMM paths, not only the
        deterministic ones as eager passes do on a bounded path (``RowSplit``): which rows
        those are changes from replay to replay, and a graph's shapes cannot."""
        self.kv_cache.meta = self._meta(shape)
        self.model.gemms.select(shape.invariant, canonical=shape.canonical)
        hidden = self.model(self.input_ids[: shape.rows], self.positions[: shape.rows], self.kv_cache)
        return self.model.compute_logits(hidden)

    def load_placeholder(self, shape: GraphShape) -> None:
        """A valid pass of graph ``shape``, writing nothing: one padding row per sequence slot,
        and for the canonical graph an empty last slot (it has one slot more than rows).
        Capture runs on it, so it must never index past the shape's rows."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.block_tables.zero_()
        self.seq_lens.fill_(1)
        self.canonical_seqs.zero_()
        self.query_start_loc[: shape.seqs + 1].copy_(torch.arange(shape.seqs + 1).clamp_(max=shape.rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every graph (largest first, so smaller ones reuse the pool's blocks); off CUDA, none."""
        if self.input_ids.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: s.rows, reverse=True):
            self.load_placeholder(shape)
            self.forward(shape)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[shape] = self.forward(shape)
            self.graphs[shape] = graph
        torch.cuda.synchronize()
        self.captured = True

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: np.ndarray,
        tables: np.ndarray,
        seq_lens: list[int],
        query_start_loc: list[int] | None = None,
        *,
        canonical: bool = False,
        invariant: bool = False,
        canonical_seqs: list[int] | None = None,
    ) -> GraphShape:
        """Copy a pass into the static buffers, padded to its graph; returns the graph's shape.

        A decode step gives one row per sequence (``query_start_loc`` None), with the
        attention flags of its sequences when deterministic rows ride in it; a canonical pass
        gives exactly its graph's rows, padding rows included.
        """
        n, s = len(input_ids), len(seq_lens)
        if canonical:
            shape = self.canonical_shape(n)
        else:
            bucket = self.bucket(n)
            assert bucket is not None
            shape = GraphShape(bucket, bucket, False, invariant and self.invariant_decode)
        assert shape in self.shapes
        qsl = list(range(n + 1)) if query_start_loc is None else query_start_loc
        rows_pad, seqs_pad = shape.rows - n, shape.seqs - s
        # Padding: rows write nothing; decode padding rows are one-key sequences, canonical
        # padding sequence slots have no rows at all.
        pad_qsl = range(n + 1, shape.rows + 1) if not canonical else [n] * seqs_pad
        # Entries past a sequence's own blocks are never read, so stale ones may stay.
        width = tables.shape[1]
        padded = np.zeros((shape.seqs, width), dtype=np.int32)
        padded[:s] = tables
        device = self.input_ids.device
        ids, pos, slot = upload(
            device,
            [
                [*input_ids, *[0] * rows_pad], [*positions, *[0] * rows_pad],
                np.concatenate([slots, np.full(rows_pad, -1)])
            ],
            torch.int64,
        )
        flags = [*(canonical_seqs or [0] * s), *[0] * (shape.seqs - len(canonical_seqs or [0] * s))]
        lens, starts, table, canonical_flags = upload(
            device, [[*seq_lens, *[1] * seqs_pad], [*qsl, *pad_qsl], padded, flags], torch.int32
        )
        self.input_ids[: shape.rows].copy_(ids)
        self.positions[: shape.rows].copy_(pos)
        self.slots[: shape.rows].copy_(slot)
        self.seq_lens[: shape.seqs].copy_(lens)
        self.query_start_loc[: shape.seqs + 1].copy_(starts)
        self.block_tables[: shape.seqs, :width].copy_(table.view(shape.seqs, width))
        self.canonical_seqs[: shape.seqs].copy_(canonical_flags)
        return shape

    def replay(self, shape: GraphShape) -> torch.Tensor:
        if not self.captured:
            return self.forward(shape)
        self.graphs[shape].replay()
        return self.logits[shape]
