"""CUDA graphs for passes with prompt rows: every kernel but attention's, replayed in pieces.

Without them such a pass runs eagerly, and a small model's eager pass is bound by the host
launching its kernels: on the H200 a Qwen3-0.6B-shaped pass took 25-28 ms at any size from
16 to 4,096 rows (Triton's launcher alone took 50-70 us a kernel on that host), several
times its GPU time. Attention cannot be captured for a row count, since its launch follows
how the rows split into sequences and how long those are. So a pass padded to a bucket's
rows is captured as ``layers + 1`` graphs cut at each layer's attention, as vLLM's piecewise
graphs are: a piece ends by storing the layer's new K/V in the cache and copying q, k and v
to static buffers, attention runs eagerly on the step's own metadata into a static output,
and the next piece reads it.

Rows past the pass's own, up to the bucket, are padding: their slots write nothing and no
sequence holds them, so attention leaves them alone, and every other kernel keeps rows
apart. Where deterministic rows ride, the graphs take the proven GEMM paths for every row
(as the decode graphs do), and under tensor parallelism their cross-rank sums take the fixed
order; the buckets are proven pass sizes, so a riding row gets the bits it gets in any other
proven pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sid.model.decoder import CausalLM
from sid.model.layers import QKRope
from sid.runtime.attention import PagedKVCache

_DENSE_FROM = 512
"""Buckets are 4 to a doubling below this many rows (such passes are bound by the host, so
padding costs nothing) and 8 from here on (padding wastes at most 1/8 of a pass)."""


def piece_buckets(max_rows: int, allowed: Sequence[int] | None = None) -> list[int]:
    """Bucket sizes from 16 rows up to the first at or above ``max_rows``, those in ``allowed`` only."""
    sizes = [16]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + (1 << sizes[-1].bit_length() - 1) // (4 if sizes[-1] < _DENSE_FROM else 8))
    return [s for s in sizes if allowed is None or s in allowed]


class PieceGraphs:
    """The pieces of every bucket over one set of static buffers; ``run`` replays a pass.

    ``forward`` is the same computation without graphs, through the same buffers: capture
    records it, and the CPU tests check it against the model's own forward."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, buckets: Sequence[int], invariant: bool) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.buckets = sorted(buckets)
        self.invariant = invariant
        shard, cfg = model.shard, model.cfg
        rows = self.buckets[-1]
        device, dtype = kv_cache.k[0].device, kv_cache.k[0].dtype
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros((rows, shard.num_heads, cfg.head_dim), dtype=dtype, device=device)
        self.k = torch.zeros((rows, shard.num_kv_heads, cfg.head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.hidden = torch.zeros((rows, cfg.hidden_size), dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.captured = False

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, bucket: int) -> None:
        """A pass's rows into the buffers; the rest of ``bucket``'s rows write nothing."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.slots[n:bucket].fill_(-1)

    def forward(self, rows: int, bucket: int, cut: _Cut | None = None) -> torch.Tensor:
        """Hidden states of the loaded ``rows``: the model over ``bucket`` rows of the buffers,
        attending (metadata set for ``rows``) inside, or, with ``cut``, as the cut says. What
        ``run`` replays, computed eagerly."""
        self.model.gemms.select(self.invariant)
        hook = cut or _Cut(self, bucket, rows)
        self.hidden[:bucket].copy_(self.model(self.input_ids[:bucket], self.positions[:bucket], hook))
        return self.hidden[:rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket's pieces, largest first (smaller ones reuse the pool's blocks).
        Each is run once before, on padding rows only: kernels compile, workspaces size. Off
        CUDA there is nothing to capture: ``run`` then computes what the pieces would."""
        if self.input_ids.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            self.slots[:bucket].fill_(-1)
            self.forward(0, bucket, _Cut(self, bucket, None))
            torch.cuda.synchronize()
            pieces = [torch.cuda.CUDAGraph()]
            with torch.cuda.stream(stream):
                pieces[0].capture_begin(pool=pool)
                self.forward(0, bucket, _Cut(self, bucket, None, (pieces, pool)))
                pieces[-1].capture_end()
            torch.cuda.synchronize()
            self.pieces[bucket] = pieces
        self.captured = True

    def run(self, rows: int, bucket: int) -> torch.Tensor:
        """Replay ``bucket``'s pieces over the loaded ``rows``, attention between them."""
        if not self.captured:
            return self.forward(rows, bucket)
        pieces = self.pieces[bucket]
        for layer, piece in enumerate(pieces[:-1]):
            piece.replay()
            self.kv_cache.attend(layer, self.q[:rows], self.k[:rows], self.v[:rows], out=self.out[:rows])
        pieces[-1].replay()
        return self.hidden[:rows]


class _Cut:
    """The model's attention hook inside ``PieceGraphs``, over ``bucket`` rows: applies the
    layer's ``QKRope`` and stores its K/V, hands q/k/v to the static buffers and returns the
    static output. It attends the first ``attend`` rows right away; capturing (``graphs``,
    ``attend`` None), it ends the layer's piece there and begins the next instead. (None alone:
    a warm-up of padding rows, whose output is whatever the buffer holds.)"""

    def __init__(
        self,
        owner: PieceGraphs,
        bucket: int,
        attend: int | None,
        graphs: tuple[list[torch.cuda.CUDAGraph], tuple[int, int]] | None = None,
    ) -> None:
        self.owner, self.bucket, self.attend, self.graphs = owner, bucket, attend, graphs
        # Under TP, pieces that may carry riding rows sum across ranks in the fixed order.
        self.canonical = owner.invariant

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: QKRope) -> torch.Tensor:
        o, n = self.owner, self.bucket
        o.kv_cache.store(layer, q, k, v, rope, o.slots[:n])
        o.q[:n].copy_(q)
        o.k[:n].copy_(k)
        o.v[:n].copy_(v)
        if self.graphs is not None:
            pieces, pool = self.graphs
            pieces[-1].capture_end()
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)
        elif self.attend is not None:
            m = self.attend
            o.kv_cache.attend(layer, o.q[:m], o.k[:m], o.v[:m], out=o.out[:m])
        return o.out[:n]
