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
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)
    row = torch.arange(int(query_start_loc[-1]), device=q_lens.device)
    pos = seq_lens[seq_idx] - q_lens[seq_idx] + (row - query_start_loc[seq_idx])
    return seq_idx, pos


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
            out[starts[s] : starts[s] + n] = _chunk_attention(q[starts[s] : starts[s] + n], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
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
) -> torch.Tensor:
    """Canonical-schedule reference: fixed tiles at absolute positions, fixed combine order.

    A row at position ``p`` attends to tiles ``0 .. p // tile``; for each (row, tile, KV
    head) its scores are one ``group x head_dim`` by ``head_dim x tile`` GEMM and its
    weighted values one ``group x tile`` by ``tile x head_dim`` GEMM, each a matrix of a
    batched matmul, whose bits depend on neither the batch count nor the batch strides
    (``tests/test_kernels.py`` checks it). The softmax subtracts the row's maximum over all
    its keys (exact in any order), and the tiles' weighted values and weight sums are folded
    in a binary tree over absolute tile indices, where tiles past the row's last are exact
    zeros. So a row's output depends only on its position and keys: not on the other rows,
    how many there are, how a prompt was chunked, nor which of the two ways below computed it
    (rows that read their own copy of their keys, or the rows of one sequence that share one).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    qf = (q.float() * scale).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    seq_idx, pos = query_positions(seq_lens, query_start_loc)
    starts = query_start_loc.tolist()
    shared = [(s, a, b) for s, (a, b) in enumerate(pairwise(starts)) if b - a >= CANONICAL_SHARED_ROWS]
    if not shared:
        out = _own_keys(qf, k_cache, v_cache, block_tables, seq_idx, pos, tile)
    else:
        out = torch.empty_like(qf)
        own = torch.ones(n, dtype=torch.bool, device=q.device)
        lens = seq_lens.tolist()
        for s, a, b in shared:
            out[a:b] = _shared_keys(qf[a:b], k_cache, v_cache, block_tables[s], lens[s] - (b - a), tile)
            own[a:b] = False
        rows = own.nonzero()[:, 0]
        if len(rows):
            out[rows] = _own_keys(qf[rows], k_cache, v_cache, block_tables, seq_idx[rows], pos[rows], tile)
    return out.view(n, num_heads, head_dim).to(q.dtype)


def _own_keys(
    qf: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    pos: torch.Tensor,
    tile: int,
) -> torch.Tensor:
    """Canonical attention of rows ``qf`` (scaled, ``[rows, kv_heads, group, head_dim]``) that
    each gather their own keys, in groups of rows whose keys fit ``CANONICAL_CHUNK``."""
    n, num_kv_heads, _, head_dim = qf.shape
    tiles = pos // tile + 1
    ends = tiles.cumsum(0)
    limit = max(1, CANONICAL_CHUNK // (tile * num_kv_heads * head_dim))  # (row, tile) pairs per group
    if int(ends[-1]) <= limit:
        return _pairs(qf, k_cache, v_cache, block_tables, seq_idx, pos, tiles, tile)
    cuts = torch.searchsorted(ends, torch.arange(limit, int(ends[-1]), limit, device=qf.device), right=True)
    bounds = sorted({0, n, *cuts.tolist()})
    return torch.cat([
        _pairs(qf[a:b], k_cache, v_cache, block_tables, seq_idx[a:b], pos[a:b], tiles[a:b], tile)
        for a, b in pairwise(bounds)
    ])


def _pairs(
    qf: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    pos: torch.Tensor,
    tiles: torch.Tensor,
    tile: int,
) -> torch.Tensor:
    """``_own_keys`` for one group: all its (row, tile) pairs at once, no op per row or tile."""
    n, num_kv_heads, group, head_dim = qf.shape
    num_pairs, width = int(tiles.sum()), _tree_width(int(tiles.max()))
    row = torch.repeat_interleave(torch.arange(n, device=qf.device), tiles, output_size=num_pairs)
    pair_tile = torch.arange(num_pairs, device=qf.device) - (tiles.cumsum(0) - tiles)[row]
    key_pos = pair_tile[:, None] * tile + torch.arange(tile, device=qf.device)  # [pairs, tile]
    row_pos = pos[row][:, None]
    # Keys past a row's position are masked anyway; gather the row's own last key in their
    # place, so unwritten slots and unused block-table entries are never read.
    slots = _slots(block_tables, seq_idx[row][:, None], torch.minimum(key_pos, row_pos), k_cache.shape[1])
    k, v = _gather_tiles(k_cache, v_cache, slots)
    scores = torch.bmm(qf.index_select(0, row).view(-1, group, head_dim), k.transpose(1, 2))
    scores = scores.view(num_pairs, num_kv_heads, group, tile)
    scores.masked_fill_((key_pos > row_pos)[:, None, None, :], float("-inf"))
    cell = pair_tile * n + row  # the pair's place in a [width, rows] grid of tiles
    maxima = torch.full((width * n, num_kv_heads, group), float("-inf"), device=qf.device)
    m = maxima.index_copy_(0, cell, scores.amax(dim=-1)).view(width, n, num_kv_heads, group).amax(dim=0)
    p = torch.exp(scores - m.index_select(0, row)[..., None])
    weighted = torch.bmm(p.view(-1, group, tile), v).view(num_pairs, num_kv_heads, group, head_dim)
    grid = torch.zeros((width * n, num_kv_heads, group, head_dim + 1), device=qf.device)
    grid.index_copy_(0, cell, torch.cat([weighted, p.sum(dim=-1, keepdim=True)], dim=-1))
    return _combine(grid.view(width, n, num_kv_heads, group, head_dim + 1))


def _shared_keys(
    qf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, first: int, tile: int
) -> torch.Tensor:
    """Canonical attention of one sequence's rows ``qf`` (scaled, ``[rows, kv_heads, group,
    head_dim]``, at positions ``first, first + 1, ...``), which read one copy of the sequence's
    keys: per (tile, KV head), one batched matmul over the rows that reach the tile, the
    tile's keys broadcast to every row (batch stride 0). In groups of rows that keep the
    scores within ``CANONICAL_CHUNK`` elements."""
    n, num_kv_heads, group, head_dim = qf.shape
    tiles = (first + n - 1) // tile + 1
    step = max(1, CANONICAL_CHUNK // (tiles * tile * num_kv_heads * group))
    if n > step:
        parts = [_shared_keys(qf[a : a + step], k_cache, v_cache, block_table, first + a, tile) for a in range(0, n, step)]
        return torch.cat(parts)
    key_pos = torch.arange(tiles * tile, device=qf.device)
    # Keys past the last row are masked for every row; read the last row's key in their place.
    slots = _slots(block_table[None, :], torch.zeros_like(key_pos), key_pos.clamp(max=first + n - 1), k_cache.shape[1])
    k, v = (x.view(tiles, num_kv_heads, tile, head_dim) for x in _gather_tiles(k_cache, v_cache, slots.view(tiles, -1)))
    reach = [max(0, t * tile - first) for t in range(tiles)]  # the first row that reaches each tile
    scores = torch.empty((tiles, num_kv_heads, n, group, tile), device=qf.device)
    for t, r in enumerate(reach):
        for h in range(num_kv_heads):
            torch.bmm(qf[r:, h], k[t, h].t().expand(n - r, head_dim, tile), out=scores[t, h, r:])
    pos = first + torch.arange(n, device=qf.device)
    # Also fills what no GEMM wrote: tiles a row does not reach are past its position.
    scores.masked_fill_(key_pos.view(tiles, 1, 1, 1, tile) > pos.view(1, 1, n, 1, 1), float("-inf"))
    p = torch.exp(scores - scores.amax(dim=(0, 4))[None, ..., None])
    weighted = torch.zeros((tiles, num_kv_heads, n, group, head_dim), device=qf.device)
    for t, r in enumerate(reach):
        for h in range(num_kv_heads):
            torch.bmm(p[t, h, r:], v[t, h].expand(n - r, tile, head_dim), out=weighted[t, h, r:])
    return _combine(torch.cat([weighted, p.sum(dim=-1, keepdim=True)], dim=-1)).transpose(0, 1)


def _gather_tiles(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``slots`` (``[tiles, tile]``) in float32, as ``[tiles * kv_heads,
    tile, head_dim]``: each (tile, KV head) one contiguous matrix, the layout every canonical
    GEMM reads."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = torch.arange(num_kv_heads, device=slots.device)
    index = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)
    shape = (-1, slots.shape[1], head_dim)
    k = k_cache.view(-1, head_dim).index_select(0, index).float().view(shape)
    return k, v_cache.view(-1, head_dim).index_select(0, index).float().view(shape)


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
