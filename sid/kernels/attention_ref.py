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
numerics contract (DESIGN 3.1): keys in tiles aligned to absolute positions, combined by
online softmax in a fixed order, so a row's output depends only on its own position and
keys, never on the other rows or on how many tiles the batch needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CANONICAL_KV_TILE = 64
"""Keys per tile of the canonical schedule; part of the numerics fingerprint."""


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

    Rows advance through tile ``t = 0, 1, ...``; a row whose position is before a tile skips
    it, which is what a pass over it would compute bit for bit (its scores would all be -inf,
    leaving the running max, sum and accumulator unchanged). Every op acts on each row with
    shapes of its own (its keys are gathered per row, its GEMMs are ``group x head_dim`` by
    ``head_dim x tile``), so a row cannot see the other rows, nor how many there are.
    """
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_idx, pos = query_positions(seq_lens, query_start_loc)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    qf = (q.float() * scale).view(n, num_kv_heads, group, head_dim)
    m = torch.full((n, num_kv_heads, group), float("-inf"), device=q.device)
    denom = torch.zeros((n, num_kv_heads, group), device=q.device)
    acc = torch.zeros((n, num_kv_heads, group, head_dim), device=q.device)
    num_tiles = (int(pos.max()) // tile + 1) if n else 0
    offsets = torch.arange(tile, device=q.device)
    for t in range(num_tiles):
        rows = (pos >= t * tile).nonzero()[:, 0]  # the rows that reach this tile (prefill: a triangle)
        r_pos = pos[rows]
        kp = (t * tile + offsets)[None, :].expand(len(rows), tile)
        # Keys past a row's position are masked anyway; gather the row's own last key in their
        # place, so unwritten slots and unused block-table entries are never read.
        read_pos = torch.minimum(kp, r_pos[:, None])
        slots = _slots(block_tables, seq_idx[rows][:, None].expand(len(rows), tile), read_pos, block_size)
        k = flat_k[slots].float()  # [rows, tile, kvh, d]
        v = flat_v[slots].float()
        scores = torch.einsum("nkgd,ntkd->nkgt", qf[rows], k)
        scores = scores.masked_fill(~(kp <= r_pos[:, None])[:, None, None, :], float("-inf"))
        m_old = m[rows]
        m_new = torch.maximum(m_old, scores.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - m_safe[..., None])
        alpha = torch.exp(m_old - m_safe)
        denom[rows] = denom[rows] * alpha + p.sum(dim=-1)
        acc[rows] = acc[rows] * alpha[..., None] + torch.einsum("nkgt,ntkd->nkgd", p, v)
        m[rows] = m_new
    out = acc / denom[..., None]
    return out.view(n, num_heads, head_dim).to(q.dtype)
