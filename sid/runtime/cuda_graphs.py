"""CUDA graphs: the fast lane's decode steps, one per batch-size bucket, and canonical passes.

A decode step or a canonical pass launches a few hundred small kernels; replaying a captured
graph removes the launch gaps. Every graph reads the same static input buffers (a pass's
rows are copied in and padded) and all graphs share one memory pool. Attention inside a
graph is launched for ``max_seq_len`` keys (the model's limit), so its schedule is fixed at
capture; rows with shorter contexts skip the empty tiles. Sampling stays outside the graph.

* A decode graph of bucket ``b`` runs ``b`` one-row sequences; rows past the step's are
  padding that writes nothing.
* The canonical graph (DESIGN 3.1) runs exactly ``canonical_rows`` rows, as the eager
  canonical pass of that size does (larger canonical passes, mostly prompts, run eagerly), over ``canonical_rows + 1`` sequence slots (a pass has at most one
  sequence per row plus the padding sequence); unused slots have no query rows, so the
  attention kernel skips them. Its schedule depends on positions only, so replaying it gives
  the eager canonical pass's bits (tests/test_gpu.py checks this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sid.model.decoder import CausalLM
from sid.runtime.attention import AttentionMetadata, PagedKVCache
from sid.runtime.transfer import upload


def canonical_key(rows: int) -> int:
    """Key of the canonical graph of ``rows`` rows (decode buckets are keyed by their batch size, >= 1)."""
    return -rows


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 below ``max_batch``, and ``max_batch`` itself."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


@dataclass(frozen=True)
class GraphShape:
    """A graph's query rows and sequence slots, and whether it is the canonical pass."""

    rows: int
    seqs: int
    canonical: bool


class CUDAGraphs:
    """The captured graphs over one set of static input buffers: ``load`` (or
    ``load_placeholder``) fills the buffers for a graph's shape, ``replay`` runs it."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        max_batch: int,
        canonical_sizes: Sequence[int] = (),
        max_blocks: int,
        max_seq_len: int,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.max_seq_len = max_seq_len
        self.buckets = decode_buckets(max_batch)
        self.shapes = {b: GraphShape(b, b, False) for b in self.buckets}
        for size in canonical_sizes:
            self.shapes[canonical_key(size)] = GraphShape(size, size + 1, True)
        device = kv_cache.k[0].device
        rows = max(s.rows for s in self.shapes.values())
        seqs = max(s.seqs for s in self.shapes.values())
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((seqs, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def has_canonical(self, rows: int) -> bool:
        return canonical_key(rows) in self.shapes

    def _meta(self, shape: GraphShape) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[: shape.rows],
            block_tables=self.block_tables[: shape.seqs],
            seq_lens=self.seq_lens[: shape.seqs],
            query_start_loc=self.query_start_loc[: shape.seqs + 1],
            max_query_len=shape.rows if shape.canonical else 1,
            max_seq_len=self.max_seq_len,
            canonical=shape.canonical,
        )

    def forward(self, key: int) -> torch.Tensor:
        """The captured computation of graph ``key``, eagerly: logits of its static rows."""
        shape = self.shapes[key]
        self.kv_cache.meta = self._meta(shape)
        hidden = self.model(self.input_ids[: shape.rows], self.positions[: shape.rows], self.kv_cache)
        return self.model.compute_logits(hidden)

    def load_placeholder(self, key: int) -> None:
        """A valid pass of graph ``key``'s shape, writing nothing: one padding row per
        sequence slot, and for the canonical graph an empty last slot (it has one slot more
        than rows). Capture runs on it, so it must never index past the shape's rows."""
        shape = self.shapes[key]
        self.input_ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.block_tables.zero_()
        self.seq_lens.fill_(1)
        self.query_start_loc[: shape.seqs + 1].copy_(torch.arange(shape.seqs + 1).clamp_(max=shape.rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every graph (largest first, so smaller ones reuse the pool's blocks)."""
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.shapes, key=lambda k: self.shapes[k].rows, reverse=True):
            self.load_placeholder(key)
            self.forward(key)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[key] = self.forward(key)
            self.graphs[key] = graph
        torch.cuda.synchronize()

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
    ) -> int:
        """Copy a pass into the static buffers, padded to its graph; returns the graph's key.

        A decode step gives one row per sequence (``query_start_loc`` None); a canonical pass
        gives exactly its graph's rows, padding rows included.
        """
        n, s = len(input_ids), len(seq_lens)
        key = canonical_key(n) if canonical else self.bucket(n)
        assert key is not None
        shape = self.shapes[key]
        assert n == shape.rows or not canonical
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
            [[*input_ids, *[0] * rows_pad], [*positions, *[0] * rows_pad], np.concatenate([slots, np.full(rows_pad, -1)])],
            torch.int64,
        )
        lens, starts, table = upload(device, [[*seq_lens, *[1] * seqs_pad], [*qsl, *pad_qsl], padded], torch.int32)
        self.input_ids[: shape.rows].copy_(ids)
        self.positions[: shape.rows].copy_(pos)
        self.slots[: shape.rows].copy_(slot)
        self.seq_lens[: shape.seqs].copy_(lens)
        self.query_start_loc[: shape.seqs + 1].copy_(starts)
        self.block_tables[: shape.seqs, :width].copy_(table.view(shape.seqs, width))
        return key

    def replay(self, key: int) -> torch.Tensor:
        self.graphs[key].replay()
        return self.logits[key]
