"""Torch references for the paged KV cache: the KV store and paged attention.

Layout shared by every backend and kernel:

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the
  token at absolute position ``p`` of a sequence lives in slot
  ``block_table[p // block_size] * block_size + p % block_size``.
* A step is a flat batch of ``N`` query tokens from ``S`` sequences; sequence ``s`` owns
  query rows ``query_start_loc[s] : query_start_loc[s + 1]``, which are its *last*
  positions: row ``i`` sits at position ``seq_lens[s] - q_len[s] + (i - query_start_loc[s])``
  and attends causally to keys ``0 .. position`` read from the cache (written first).

These functions are the numerical ground truth for the Triton kernels and the CPU
attention backend. ``paged_attention_canonical_ref`` is the canonical schedule of the
numerics contract (DESIGN 3.1): keys in tiles aligned to absolute positions, combined in a
fixed order, so a row's output depends only on its own position and keys, never on the
other rows or on how many tiles the batch needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

CANONICAL_KV_TILE = 64
"""Keys per tile of the canonical schedule; part of the numerics fingerprint."""
CANONICAL_SHARED_ROWS = 8
"""From this many query rows of one sequence on, the canonical reference reads the sequence's
keys once for all of them instead of once per row: a speed choice that changes no bits."""
CANONICAL_CHUNK = 1 << 22
"""Elements of the canonical reference's largest temporary (gathered keys, or scores) above
which it takes its rows in groups: a bound on memory that changes no bits."""


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[N, kv_heads, head_dim]`` into their slots; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def query_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: (sequence index, absolute position)."""
    row = torch.arange(int(query_start_loc[-1]), dtype=query_start_loc.dtype, device=query_start_loc.device)
    seq_idx = segment_of(query_start_loc[1:], row)
    return seq_idx, seq_lens[seq_idx] - (query_start_loc[seq_idx + 1] - row)


def segment_of(ends: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """For each of ``index``, the segment it falls in, where segment ``s`` ends before
    ``ends[s]`` (ascending, empty segments allowed). ``torch.repeat_interleave`` gives the same,
    but in a parallel region however few the elements, which a CPU pays for at every call."""
    return torch.searchsorted(ends, index, right=True)


def _slots(block_tables: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each (sequence, position); positions past the table clamp to block 0's slot."""
    block_col = torch.clamp(pos // block_size, max=block_tables.shape[1] - 1)
    block = block_tables[seq_idx, block_col].long().clamp(min=0)
    return block * block_size + pos % block_size


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Fast-schedule reference: all single-row (decode) sequences in one padded batch, then
    SDPA per multi-row (prefill chunk) sequence."""
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        idx = torch.tensor(decodes, device=q.device)
        rows = query_start_loc[idx].long()
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, n in enumerate(q_lens):
        if n > 1:
            out[starts[s] : starts[s] + n] = _chunk_attention(
                q[starts[s] : starts[s] + n], k_cache, v_cache, block_tables[s], lens[s], scale
            )
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float
) -> torch.Tensor:
    """One query row per sequence, keys padded to the longest context and masked."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ctx = int(seq_lens.max())
    pos = torch.arange(ctx, device=q.device)[None, :].expand(n, ctx)
    seq_idx = torch.arange(n, device=q.device)[:, None].expand(n, ctx)
    # Padding keys (masked below) re-read the sequence's last key: never an unwritten slot or unused table entry.
    slots = _slots(block_tables, seq_idx, torch.minimum(pos, seq_lens[:, None] - 1), block_size)
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)  # [n, ctx, kvh, d]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)
    group = num_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, head_dim)
    scores = torch.einsum("nkgd,nckd->nkgc", qg.float(), k.float()) * scale
    scores = scores.masked_fill((pos >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    out = torch.einsum("nkgc,nckd->nkgd", scores.softmax(dim=-1), v.float())
    return out.reshape(n, num_heads, head_dim).to(q.dtype)


def _chunk_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, ctx: int, scale: float
) -> torch.Tensor:
    """Several query rows of one sequence (its last positions), causal over the cached keys."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(ctx, device=q.device)
    slots = _slots(block_table[None, :], torch.zeros_like(pos), pos, block_size)
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1).to(q.dtype)  # [kvh, ctx, d]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1).to(q.dtype)
    mask = pos[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return o.transpose(0, 1)


def paged_attention_canonical_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    tile: int = CANONICAL_KV_TILE,
    plan: CanonicalPlan | None = None,
) -> torch.Tensor:
    """Canonical-schedule reference: fixed tiles at absolute positions, fixed combine order.

    A row at position ``p`` attends to tiles ``0 .. p // tile``; for each (row, tile, KV
    head) its scores are one ``group x head_dim`` by ``head_dim x tile`` GEMM and its
    weighted values one ``group x tile`` by ``tile x head_dim`` GEMM, each a matrix of a
    batched matmul, whose bits depend on neither the batch count nor the batch strides on
    the CPU, the backend this schedule serves (``tests/test_kernels.py`` checks it; on CUDA
    cuBLAS picks its batched kernel by batch count, and the Triton kernel serves instead).
    The softmax subtracts the row's maximum over all its keys (exact in any order), and the
    tiles' weighted values and weight sums are folded in a binary tree over absolute tile
    indices, where tiles past the row's last are exact zeros. So a row's output depends only
    on its position and keys: not on the other rows, how many there are, how a prompt was
    chunked, nor which of the two ways of ``canonical_plan`` computed it. ``plan`` is that index
    work for these rows, if already done.
    """
    if plan is None:
        plan = canonical_plan(q.shape[1], k_cache, block_tables, seq_lens, query_start_loc, tile)
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    qf = (q.float() * scale).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(qf)
    for part in plan.parts:
        out[part.rows] = part.attend(qf[part.rows], k_cache, v_cache)
    return out.view(n, num_heads, head_dim).to(q.dtype)


@dataclass
class _Pairs:
    """Rows that each gather their own keys: all their (row, tile) pairs at once, in one
    batched matmul per GEMM, with no op per row or tile."""

    rows: slice | torch.Tensor
    """This part's rows of the batch."""
    row: torch.Tensor
    """Per pair: its row, within this part."""
    cell: torch.Tensor
    """Per pair: its place in a ``[width, rows]`` grid of tiles."""
    past: torch.Tensor
    """Per pair ``[pairs, 1, 1, tile]``: keys past the row's position."""
    index: torch.Tensor
    """The cache rows (of ``[slots * kv_heads, head_dim]``) of every pair's keys and values."""
    width: int
    """Leaves of the combine tree."""

    @classmethod
    def plan(
        cls,
        rows: slice | torch.Tensor,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_idx: torch.Tensor,
        pos: torch.Tensor,
        tiles: torch.Tensor,
        tile: int,
    ) -> _Pairs:
        ends = tiles.cumsum(0)
        n, num_pairs = len(pos), int(ends[-1])
        pairs = torch.arange(num_pairs, device=pos.device)
        row = segment_of(ends, pairs)
        pair_tile = pairs - (ends - tiles)[row]
        key_pos = pair_tile[:, None] * tile + torch.arange(tile, device=pos.device)  # [pairs, tile]
        row_pos = pos[row][:, None]
        # Keys past a row's position are masked anyway; gather the row's own last key in their
        # place, so unwritten slots and unused block-table entries are never read.
        slots = _slots(block_tables, seq_idx[row][:, None], torch.minimum(key_pos, row_pos), k_cache.shape[1])
        width = _tree_width(int(tiles.max()))
        return cls(
            rows, row, pair_tile * n + row, (key_pos > row_pos)[:, None, None, :], _gather_index(k_cache, slots), width
        )

    def attend(self, qf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Scaled queries ``[rows, kv_heads, group, head_dim]`` -> float32 outputs of that shape."""
        n, num_kv_heads, group, head_dim = qf.shape
        num_pairs, tile = self.past.shape[0], self.past.shape[-1]
        k, v = _gather(k_cache, self.index, tile), _gather(v_cache, self.index, tile)
        scores = torch.bmm(qf.index_select(0, self.row).view(-1, group, head_dim), k.transpose(1, 2))
        scores = scores.view(num_pairs, num_kv_heads, group, tile).masked_fill_(self.past, float("-inf"))
        maxima = torch.full((self.width * n, num_kv_heads, group), float("-inf"), device=qf.device)
        maxima.index_copy_(0, self.cell, scores.amax(dim=-1))
        m = maxima.view(self.width, n, num_kv_heads, group).amax(dim=0)  # every pair's tile has a valid key
        p = torch.exp(scores - m.index_select(0, self.row)[..., None])
        weighted = torch.bmm(p.view(-1, group, tile), v).view(num_pairs, num_kv_heads, group, head_dim)
        grid = torch.zeros((self.width * n, num_kv_heads, group, head_dim + 1), device=qf.device)
        grid.index_copy_(0, self.cell, torch.cat([weighted, p.sum(dim=-1, keepdim=True)], dim=-1))
        return _combine(grid.view(self.width, n, num_kv_heads, group, head_dim + 1))


@dataclass
class _Shared:
    """Rows of one sequence (consecutive positions from ``first``) that read one copy of its
    keys: per (tile, KV head), one batched matmul over the rows that reach the tile, the
    tile's keys broadcast to every row (batch stride 0)."""

    rows: slice
    first: int
    past: torch.Tensor
    """``[tiles, 1, rows, 1, tile]``: keys past each row's position."""
    index: torch.Tensor
    """The cache rows of the sequence's keys and values, as in ``_Pairs``."""

    @classmethod
    def plan(cls, rows: slice, k_cache: torch.Tensor, block_table: torch.Tensor, first: int, tile: int) -> _Shared:
        n = rows.stop - rows.start
        tiles = (first + n - 1) // tile + 1
        key_pos = torch.arange(tiles * tile, device=block_table.device)
        # Keys past the last row are masked for every row; read the last row's key in their place.
        slots = _slots(
            block_table[None, :], torch.zeros_like(key_pos), key_pos.clamp(max=first + n - 1), k_cache.shape[1]
        )
        pos = first + torch.arange(n, device=block_table.device)
        past = key_pos.view(tiles, 1, 1, 1, tile) > pos.view(1, 1, n, 1, 1)
        return cls(rows, first, past, _gather_index(k_cache, slots.view(tiles, tile)))

    def attend(self, qf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """As ``_Pairs.attend``."""
        n, num_kv_heads, group, head_dim = qf.shape
        tiles, tile = self.past.shape[0], self.past.shape[-1]
        k = _gather(k_cache, self.index, tile).view(tiles, num_kv_heads, tile, head_dim)
        v = _gather(v_cache, self.index, tile).view(tiles, num_kv_heads, tile, head_dim)
        reach = [max(0, t * tile - self.first) for t in range(tiles)]  # the first row that reaches each tile
        scores = torch.empty((tiles, num_kv_heads, n, group, tile), device=qf.device)
        for t, r in enumerate(reach):
            for h in range(num_kv_heads):
                torch.bmm(qf[r:, h], k[t, h].t().expand(n - r, head_dim, tile), out=scores[t, h, r:])
        scores.masked_fill_(self.past, float("-inf"))  # also what no GEMM wrote: tiles past a row's position
        p = torch.exp(scores - scores.amax(dim=(0, 4))[None, ..., None])
        weighted = torch.zeros((tiles, num_kv_heads, n, group, head_dim), device=qf.device)
        for t, r in enumerate(reach):
            for h in range(num_kv_heads):
                torch.bmm(p[t, h, r:], v[t, h].expand(n - r, tile, head_dim), out=weighted[t, h, r:])
        return _combine(torch.cat([weighted, p.sum(dim=-1, keepdim=True)], dim=-1)).transpose(0, 1)


@dataclass
class CanonicalPlan:
    """The canonical reference's index work for a batch of rows (``canonical_plan``). It
    depends on the batch's metadata alone, so every layer of a step can share it."""

    parts: list[_Pairs | _Shared]


def canonical_plan(
    num_heads: int,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile: int = CANONICAL_KV_TILE,
) -> CanonicalPlan:
    """How ``paged_attention_canonical_ref`` takes the rows of a batch (of ``num_heads`` query
    heads; of the cache only the shape is read).

    The rows of a sequence with at least ``CANONICAL_SHARED_ROWS`` of them share one copy of
    its keys, in groups whose scores fit ``CANONICAL_CHUNK``; the other rows gather their own,
    in groups whose keys fit it. Either way a row gets the same bits.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    seq_idx, pos = query_positions(seq_lens, query_start_loc)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    n = starts[-1]
    parts: list[_Pairs | _Shared] = []
    own: slice | torch.Tensor = slice(0, n)
    for s, (a, b) in enumerate(pairwise(starts)):
        if b - a < CANONICAL_SHARED_ROWS:
            continue
        step = max(1, CANONICAL_CHUNK // ((lens[s] - 1) // tile + 1) // (tile * num_heads))  # rows per group
        for start in range(a, b, step):
            rows = slice(start, min(start + step, b))
            parts.append(_Shared.plan(rows, k_cache, block_tables[s], lens[s] - b + start, tile))
        if isinstance(own, slice):
            own = torch.ones(n, dtype=torch.bool, device=pos.device)
        own[a:b] = False
    if isinstance(own, torch.Tensor):
        own = own.nonzero()[:, 0]
        seq_idx, pos = seq_idx[own], pos[own]
    if len(pos):
        tiles = pos // tile + 1
        ends = tiles.cumsum(0)
        limit = max(1, CANONICAL_CHUNK // (tile * num_kv_heads * head_dim))  # (row, tile) pairs per group
        bounds = [0, len(pos)]
        if int(ends[-1]) > limit:
            cuts = torch.searchsorted(ends, torch.arange(limit, int(ends[-1]), limit, device=pos.device), right=True)
            bounds = sorted({*bounds, *cuts.tolist()})
        for a, b in pairwise(bounds):
            rows = slice(a, b) if isinstance(own, slice) else own[a:b]
            parts.append(_Pairs.plan(rows, k_cache, block_tables, seq_idx[a:b], pos[a:b], tiles[a:b], tile))
    return CanonicalPlan(parts)


def _gather_index(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of the cache viewed as ``[slots * kv_heads, head_dim]`` that ``_gather`` reads
    for ``slots`` (``[tiles, tile]``), ordered (tile, KV head, key)."""
    num_kv_heads = k_cache.shape[2]
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)


def _gather(cache: torch.Tensor, index: torch.Tensor, tile: int) -> torch.Tensor:
    """Keys or values at ``index`` in float32, ``[tiles * kv_heads, tile, head_dim]``: each
    (tile, KV head) one contiguous matrix, the layout every canonical GEMM reads."""
    head_dim = cache.shape[-1]
    return cache.view(-1, head_dim).index_select(0, index).float().view(-1, tile, head_dim)


def _tree_width(tiles: int) -> int:
    """Leaves of the combine tree: ``tiles`` rounded up to a power of two."""
    return 1 << (tiles - 1).bit_length()


def _combine(grid: torch.Tensor) -> torch.Tensor:
    """The output from per-tile [weighted values | weight sum] (``grid``, tiles on dim 0): a
    binary tree over absolute tile indices, its leaves padded to a power of two. Tiles past a
    row's last are zeros, and adding zeros leaves every node's bits alone, so the tree's width
    does not matter."""
    width = _tree_width(grid.shape[0])
    if width > grid.shape[0]:
        grid = torch.cat([grid, grid.new_zeros((width - grid.shape[0], *grid.shape[1:]))])
    while grid.shape[0] > 1:
        grid = grid[0::2] + grid[1::2]
    return grid[0, ..., :-1] / grid[0, ..., -1:]
