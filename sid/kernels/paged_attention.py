"""Triton paged attention: varlen, causal, GQA, mixed prefill chunks and decodes in one launch.

Layout and semantics are those of ``sid.kernels.attention_ref`` (the torch references).

One kernel body serves both schedules. A program owns one *query block* (``BLOCK_Q``
positions of one sequence, aligned to multiples of ``BLOCK_Q``, times the ``GROUP`` query
heads that share one KV head, packed into ``BLOCK_M`` rows so K/V are read once per KV head)
and one KV *split* (keys ``[split * split_size, (split + 1) * split_size)``). It walks that
range in tiles of ``TILE`` keys aligned to absolute positions, with an online softmax in
increasing tile order. A row whose keys all lie in split 0 is finished there and written
directly; other rows leave per-split partials (max, sum, accumulator) that
``_combine_kernel`` merges in increasing split order.

* Fast schedule (``canonical=False``): block shape, tile and split size are chosen from the
  batch (small BLOCK_M and long tiles for decode-only steps; split-KV only when the grid would
  otherwise leave multiprocessors idle, flash-decoding style).
* Canonical schedule (``canonical=True``, DESIGN 3.1): every constant is fixed
  (``CANONICAL_CONFIG``), so a row's arithmetic is a function of its own position and keys
  only. A position always occupies the same row of its query block; tiles and splits sit at
  fixed absolute positions, and tiles past a row's last key are exact no-ops (scores -inf,
  rescale factor forced to 1), so neither the other rows, the query tiling, the number of
  tiles/splits the batch needs, nor prefill-vs-decode can change its bits. Integer arguments
  that depend on the batch are not specialised by Triton, so every batch runs the same
  compiled kernel.

Floor: decode attention is memory-bound; a step cannot beat
``(K + V bytes read + Q bytes read + O bytes written) / HBM bandwidth``, i.e. per sequence
``2 * seq_len * kv_heads * head_dim * cache bytes`` plus ``2 * q_rows * heads * head_dim *
q bytes``, over ~3.7 TB/s on the H200 (Llama-3.1-8B, bf16, 8192 keys: 32 MiB, ~9 us per
sequence and layer). Split-KV partials add ``q_rows * heads * splits * (head_dim + 2) * 8``
bytes. Measured on the H200 (benchmarks/attention.py, CUDA graphs, 2026-11-29): the fast
schedule reaches 0.9-1.0 of the floor from 32 x 8192 or 128 x 2048 (batch x context) up, the
canonical one 0.80-0.86 (Llama-3.1-8B, GQA 4) and 0.66-0.68 (Qwen3-0.6B, GQA 2); single-digit
batches are latency-bound (16-50 us per layer). Prefill (8 x 2048) runs at ~225 TFLOP/s fast
and ~120 canonical, a third of the bf16 matmul rate or less.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

CANONICAL_CONFIG: dict[str, int] = {
    "block_m": 16,
    "kv_tile": 128,
    "kv_split": 4096,
    "num_warps": 4,
    "num_stages": 3,
}
"""Fixed launch constants of the canonical schedule; part of the numerics fingerprint.

``block_m`` is raised to the next power of two of the GQA group when the group is larger
(a function of the model, never of the batch). Tiles sit at multiples of ``kv_tile``
absolute positions, split boundaries at multiples of ``kv_split``. Chosen on the H200 by
``benchmarks/canonical_sweep.py`` over the canonical lane's own shapes, Qwen3-0.6B and
Llama-3.1-8B head layouts, canonical time over fast time on the same inputs: for 256
decoding sequences of 1,536 keys (a whole canonical step) 1.00 with kv_split 4096 against
1.10 with 1024, which splits them; for 64 sequences 0.93 against 1.01; 256-row prompt
chunks 0.70-1.36 against 0.79-1.43 (block_m 32 gave 1.11-1.34 for decode). Contexts above
4,096 keys are split, so a long decode still spreads over the multiprocessors.
"""

_COMBINE_NUM_WARPS = 4
_FAST_MIN_SPLIT_KEYS = 256
"""Fast schedule: a split is never shorter than this, so the partials stay cheap."""
_FAST_PROGRAMS_PER_SM = 4
_NOMINAL_SMS = 8
"""Stand-in multiprocessor count off CUDA (the interpreter), so CPU runs exercise split-KV."""


def _patch_interpreter_scalar_index() -> None:
    """Let Triton 3.6's CPU interpreter run ``range`` loops with tensor bounds under NumPy >= 2.4.

    Its scalars are 1-element arrays turned into ints with ``int(array)``, which NumPy 2.4
    refuses (triton-lang/triton#9171, fixed after 3.6). The compiled (GPU) path is untouched;
    this keeps one kernel source with ``for`` loops, which Triton software-pipelines (measured
    on the H200: ~25% faster decode than a ``while`` loop, which it does not pipeline).
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if knobs.runtime.interpret:
    _patch_interpreter_scalar_index()


class _Schedule(NamedTuple):
    block_m: int
    kv_tile: int
    split_size: int
    num_warps: int
    num_stages: int


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning ``q_block``: the last s with ``query_start_loc[s] // BLOCK_Q + 2 * s <= q_block``.

    Sequence s owns blocks ``[qsl[s] // BLOCK_Q + 2s, qsl[s + 1] // BLOCK_Q + 2s + 2)``: at least
    ``q_len // BLOCK_Q + 2``, enough for its rows in position-aligned blocks. So a grid of
    ``N // BLOCK_Q + 2S`` blocks covers every row without reading lengths on the host; surplus
    blocks exit at once.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + 2 * mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _block_rows(
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Rows of this program's query block: sequence, flat token, head, validity and position.

    Blocks are aligned to absolute positions: block ``j`` of a sequence holds positions
    ``[j * BLOCK_Q, (j + 1) * BLOCK_Q)``, and row ``m`` is position ``j * BLOCK_Q + m // GROUP``,
    head ``kv_head * GROUP + m % GROUP``. A position therefore always sits in the same row of
    the tile, whatever the batch (matrix units need not treat every row alike). Rows that are
    not this step's queries are padding: they repeat a valid row and are never stored.
    Returns (sequence, done, flat token, head, valid, position, last valid position).
    """
    q_block = tl.program_id(0)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query = seq_len - q_len
    block_start = (first_query // BLOCK_Q + q_block - q_start // BLOCK_Q - 2 * seq) * BLOCK_Q
    done = (q_len == 0) | (block_start >= seq_len)
    last_pos = tl.minimum(block_start + BLOCK_Q, seq_len) - 1
    m = tl.arange(0, BLOCK_M)
    pos = block_start + m // GROUP
    valid = (pos >= first_query) & (pos <= last_pos) & (m < BLOCK_Q * GROUP)
    pos = tl.minimum(tl.maximum(pos, first_query), last_pos)
    token = (q_start + pos - first_query).to(tl.int64)
    head = tl.program_id(1) * GROUP + m % GROUP
    return seq, done, token, head, valid, pos, last_pos


@triton.jit(do_not_specialize=["num_seqs", "split_size", "num_splits", "stride_bt"])
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    num_seqs,
    split_size,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Online-softmax attention of one query block over one KV split (see the module doc)."""
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q
    )
    split_start = tl.program_id(2) * split_size
    if done | (split_start > last_pos):
        return
    kv_stop = tl.minimum(split_start + split_size, last_pos + 1)
    kv_head = tl.program_id(1)
    dims = tl.arange(0, DIM)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=valid[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = q.to(DOT_DTYPE)
    precision: tl.constexpr = "ieee" if DOT_DTYPE == tl.float32 else "tf32"
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    for tile_start in range(split_start, kv_stop, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_ok = keys < kv_stop
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + offset[None, :] * stride_ks
            + kv_head * stride_kh
            + dims[:, None] * stride_kd,
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + dims[None, :] * stride_vd,
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=precision) * qk_scale
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Forced to exactly 1 when the max is unchanged (e.g. a tile past the row's position).
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=precision)
        m_i = m_new
    out_mask = valid[:, None] & dim_ok[None, :]
    complete = (pos < split_size) & (split_start == 0)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=out_mask & complete[:, None],
    )
    partial = valid & (pos >= split_start) & ~complete
    part = (token * tl.num_programs(1) * GROUP + head) * num_splits + tl.program_id(2)
    tl.store(part_max_ptr + part, m_i, mask=partial)
    tl.store(part_sum_ptr + part, l_i, mask=partial)
    tl.store(part_acc_ptr + part[:, None] * DIM + dims[None, :], acc, mask=partial[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "split_size", "num_splits"])
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    split_size,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
):
    """Merge the split partials of the rows that span several splits, in increasing split order."""
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q
    )
    if done | (last_pos < split_size):
        return
    dims = tl.arange(0, DIM)
    dim_ok = dims < HEAD_DIM
    row_splits = pos // split_size + 1
    rows = valid & (row_splits > 1)
    part = (token * tl.num_programs(1) * GROUP + head) * num_splits
    m_i = tl.load(part_max_ptr + part, mask=rows, other=0.0)
    l_i = tl.load(part_sum_ptr + part, mask=rows, other=1.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM + dims[None, :], mask=rows[:, None] & dim_ok[None, :], other=0.0)
    for split in range(1, last_pos // split_size + 1):
        live = rows & (split < row_splits)
        m_s = tl.load(part_max_ptr + part + split, mask=live, other=float("-inf"))
        l_s = tl.load(part_sum_ptr + part + split, mask=live, other=0.0)
        acc_s = tl.load(
            part_acc_ptr + (part + split)[:, None] * DIM + dims[None, :],
            mask=live[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        beta = tl.exp2(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=rows[:, None] & dim_ok[None, :],
    )


def _dot_dtype(q: torch.Tensor) -> tl.dtype:
    """Matrix-unit operand type: the query's, except bf16 off CUDA, where Triton 3.6's
    interpreter multiplies bf16 operands as raw integers (exact fp32 products stand in)."""
    if q.dtype == torch.bfloat16 and q.device.type != "cuda":
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype]


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _NOMINAL_SMS


@functools.lru_cache(maxsize=None)
def _unused_partials(device: torch.device) -> torch.Tensor:
    """Stand-in partial buffer when nothing splits: same dtype, so the same compiled kernel."""
    return torch.empty(1, dtype=torch.float32, device=device)


def _canonical_schedule(group: int) -> _Schedule:
    """The fixed canonical launch: a function of the model (GQA group) only."""
    cfg = CANONICAL_CONFIG
    return _Schedule(
        block_m=max(cfg["block_m"], triton.next_power_of_2(group)),
        kv_tile=cfg["kv_tile"],
        split_size=cfg["kv_split"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _fast_schedule(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
) -> _Schedule:
    """Fastest launch for this batch (tuned on the H200, Llama-3.1-8B shapes): small query
    blocks and long tiles for decode-only steps, big blocks for prefill, and split-KV when the
    grid would leave multiprocessors idle."""
    if max_query_len == 1:
        block_m, kv_tile, num_warps = max(16, triton.next_power_of_2(group)), 128, 4
    else:
        block_m, kv_tile, num_warps = max(128, triton.next_power_of_2(group)), 64, 8
    block_q = block_m // group
    programs = min(num_seqs * triton.cdiv(max_query_len, block_q), num_tokens // block_q + num_seqs) * num_kv_heads
    target = _FAST_PROGRAMS_PER_SM * _num_sms(device)
    splits = max(1, min(triton.cdiv(target, programs), max_seq_len // _FAST_MIN_SPLIT_KEYS))
    split_size = triton.cdiv(triton.cdiv(max_seq_len, splits), kv_tile) * kv_tile
    return _Schedule(block_m, kv_tile, split_size, num_warps, num_stages=3)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    canonical: bool,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen paged attention of ``q`` ``[N, heads, head_dim]`` over the cache.

    Semantics of ``paged_attention_ref`` (fast) / ``paged_attention_canonical_ref``
    (``canonical=True``, bit-stable per row). ``max_query_len`` / ``max_seq_len`` are host
    copies of the batch maxima; pass them to keep the launch free of device syncs (the
    canonical schedule needs only ``max_seq_len``). Returns ``out`` (allocated if None).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if canonical:
        sched = _canonical_schedule(group)
    else:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        sched = _fast_schedule(num_tokens, num_seqs, group, num_kv_heads, max_query_len, max_seq_len, q.device)
    block_q = sched.block_m // group
    num_splits = triton.cdiv(max_seq_len, sched.split_size)
    dim = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = _unused_partials(q.device)
    grid = (num_tokens // block_q + 2 * num_seqs, num_kv_heads)
    _attention_kernel[(*grid, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_max,
        part_sum,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * 1.4426950408889634,
        num_seqs,
        sched.split_size,
        num_splits,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_M=sched.block_m,
        BLOCK_Q=block_q,
        TILE=sched.kv_tile,
        HEAD_DIM=head_dim,
        DIM=dim,
        DOT_DTYPE=_dot_dtype(q),
        num_warps=sched.num_warps,
        num_stages=sched.num_stages,
    )
    if num_splits > 1:
        _combine_kernel[grid](
            out,
            part_acc,
            part_max,
            part_sum,
            seq_lens,
            query_start_loc,
            num_seqs,
            sched.split_size,
            num_splits,
            *out.stride(),
            GROUP=group,
            BLOCK_M=sched.block_m,
            BLOCK_Q=block_q,
            HEAD_DIM=head_dim,
            DIM=dim,
            num_warps=_COMBINE_NUM_WARPS,
        )
    return out
