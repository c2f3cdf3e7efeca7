"""Prompt attention for Hopper (sm_90) in both schedules, written in Gluon.

The Triton kernel in ``paged_attention`` leaves its prompt launch's pipelining to the
compiler, which on sm_90 waits for each ``Q Kᵀ`` before the softmax and each ``P V`` before
the next tile: the matrix unit idles while the exponentials run, the cost FlashAttention-3
hides. Here its schedule is written out. A program is warp-specialised: one warp loads K/V
tiles by TMA into a ring of shared-memory stages ahead of their use, and two consumer
warpgroups of 64 rows each overlap a tile's softmax with the matrix unit twice over: inside a
warpgroup, tile ``j``'s ``Q Kⱼᵀ`` and tile ``j - 1``'s ``P V`` are issued together as
asynchronous wgmmas and the softmax runs while ``P V`` does; between the two, they take turns
to issue, so one's softmax runs while the other's products do (ping-pong).

Semantics: causal, varlen, GQA, a chunk's keys after a cached prefix, for the sequences of
one schedule (``flags``: 0 fast, else canonical; the others are skipped). A program owns one
query block, ``BLOCK_Q = BLOCK_M / GROUP`` positions of one sequence times the ``GROUP`` query
heads of one KV head packed into ``BLOCK_M`` rows (K/V read once per KV head), numbered
longest first as in the Triton launch, and walks every key its rows see in tiles at absolute
positions: whole tiles unmasked, the diagonal ones masked. A tile of the chunk's own keys is
one TMA load of ``k``/``v``; a tile holding cached keys is gathered block by block through the
block table from the cache (the chunk's own keys are stored there as well).

* Fast (``paged_attention_ref``): 64-key tiles, the scale folded into the exponent's FMA.
* Canonical (``paged_attention_canonical_ref``, DESIGN 3.1): the Triton kernel's tiles (128
  keys) and splits (``Canonical``), and its arithmetic operation for operation, so a row gets the
  bits the Triton kernel gives it in any launch: each split from a fresh state, folded left to
  right into the row's as soon as its last product is in, in the same program. Both kernels'
  PTX for sm_90a has the same kinds of instruction on each line of the softmax, the merge and
  the rescale (``mul.rn``, ``ex2.approx.ftz``, ``fma.rn``, the rounding to bf16, ``div.full``);
  the row sum's wgmma is 8 wide here, 16 there (each column the same dot product of a row's
  weights with ones).

``paged_attention`` runs its prompt launches here with ``SID_HOPPER_PREFILL=1``
(``HOPPER_PREFILL``). The canonical schedule gives every row the Triton kernel's bits (H100,
2026-12-07, GQA 1-8, head_dim 64/128, cache blocks 16/128, ``tests/test_hopper_prefill.py``)
since its row sum's ones are kept transposed: kept ``[keys, 8]``, their wgmma descriptors had
nonzero base offsets (2, 4, 6; PTX gives 0 for canonical layouts), rows that saw key 32 or
later were wrong and head_dim 64 read an illegal address. Timed then, it was no quicker than
the Triton kernel (0.32-0.51 of the matmul rate against 0.31-0.54). Three changes made it so
(0.46-0.60 against 0.35-0.56, H100, 33b44c0): a split's fold waits for the next split's first
softmax (before, the product was waited for first, every 256 keys), the row sum runs
asynchronously, and the fold's values move through shared memory without bank conflicts.

Floor: ``4 * heads * head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)`` FLOPs a sequence
over the measured bf16 matmul rate (``benchmarks/attention.py`` reports the ratio). Gluon runs
on a GPU only: on the CPU, ``tests/sm90_shared_memory.py`` compiles it for sm_90a.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sid.kernels.launch import Relaunch

BLOCK_M = 128
"""Rows of a program: two warpgroups of 64, each a consumer partition."""
BLOCK_N = 64
"""Keys of a fast tile. 64-key tiles in four stages beat 128-key tiles in two by 1.07-1.40x on
an H100 (8 x 2k to a 2k chunk after a 16k prefix, Llama-3.1-8B and Qwen3-0.6B heads;
2026-12-06): a consumer's softmax of a tile fits its registers beside the accumulator."""
STAGES = 4
"""Fast K/V tiles in flight: 4 x 32 KB at head_dim 128, beside the 32 KB query tile."""
LAUNCH_REGISTERS = 168
"""Registers a thread launches with: sm_90's 65,536 over a program's 384 threads (Triton pads
the load warp's partition to a warpgroup). 224 compiled but was refused at launch (384 x 224
> 65,536; H100, 2026-12-07). The partitions then trade them by ``setmaxnreg``: the load warp
gives back down to ``LOADER_REGISTERS``, the second consumer takes ``CONSUMER_REGISTERS`` and
the first (the default partition) what is left."""
CONSUMER_REGISTERS = gl.constexpr(240)
LOADER_REGISTERS = {False: 40, True: 56}
"""A load warp's registers, fast and canonical (ptxas -v for sm_90a, 2026-12-07): fast, 40 leave
the first consumer 224 and nothing spills; canonical, 56 leave it 208 and nothing spills (40
and 48: 4 bytes a thread; 32: 16, the load warp's, which gathers a tail's values)."""
FOLD_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [1, 0]))
"""Shared-memory layout of the canonical fold's weighted values: a wgmma accumulator's rows
stored and loaded without bank conflicts (``tests/test_kernels.py``); unswizzled, each access
took four wavefronts where one would do (Triton's count, 2026-12-07, after a first run at 0.40
of the matmul rate against the fast kernel's 0.70)."""
LOG2E = 1.4426950408889634
"""log2(e): both attention kernels take exponents base 2, the scale multiplied by it on the host
(one constant, so the Triton and Gluon kernels get the same scale's bits)."""
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def stages(tile: int) -> int:
    """K/V stages of a walk over ``tile``-key tiles: the fast walk's bytes in flight (four of 64
    keys, two of the canonical schedule's 128). Three of 128 would pass sm_90's 227 KB beside the
    canonical fold's values."""
    return STAGES * BLOCK_N // tile


class Canonical(NamedTuple):
    """The canonical schedule's tiling (``paged_attention.CANONICAL_CONFIG``): ``tile`` keys a
    tile, splits of ``split`` keys doubled until a row has at most ``row_splits`` (0: fixed)."""

    tile: int
    split: int
    row_splits: int


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """This kernel can run a step of ``q``'s shape over ``k_cache``: an sm_90 device, 16-bit
    data, a head_dim of 64 or 128, a GQA group that divides ``BLOCK_M``, and a contiguous
    cache (the pass's own keys must be given, laid out as ``_descriptor`` says)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    group = q.shape[1] // k_cache.shape[2]
    return (
        q.dtype in _GL_DTYPES
        and k_cache.dtype == q.dtype
        and q.shape[-1] in (64, 128)
        and BLOCK_M % group == 0
        and k_cache.is_contiguous()
    )


@gluon.constexpr_function
def _mma_layout(columns: int) -> gl.NVMMADistributedLayout:
    """A warpgroup's wgmma accumulator of 64 rows and ``columns`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.jit
def _find_seq(query_start_loc_ptr, row0, q_block, num_seqs, BLOCK_Q: gl.constexpr):
    """Sequence owning ``q_block`` under the Triton launch's numbering (``paged_attention``'s
    ``_find_seq``): sequence s owns blocks from ``r(s) // BLOCK_Q + 2 s``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if (gl.load(query_start_loc_ptr + mid) - row0) // BLOCK_Q + 2 * mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@gluon.jit
def _block_of(query_start_loc_ptr, seq_lens_ptr, flags_ptr, num_seqs, BLOCK_Q: gl.constexpr,
              CANONICAL: gl.constexpr):  # fmt: skip
    """This program's query block, longest first: (sequence, its first query row, the chunk's
    first position, the sequence's length, the block's start, the first and last position of
    its rows, nothing to do: past the chunk, or a sequence of the other schedule). The
    arithmetic of ``paged_attention._block_rows``, which a Gluon kernel cannot call."""
    q_block = gl.num_programs(0) - 1 - gl.program_id(0)
    row0 = gl.load(query_start_loc_ptr)
    seq = _find_seq(query_start_loc_ptr, row0, q_block, num_seqs, BLOCK_Q)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = gl.load(seq_lens_ptr + seq)
    first_query = seq_len - q_len
    block_start = (first_query // BLOCK_Q + q_block - (q_start - row0) // BLOCK_Q - 2 * seq) * BLOCK_Q
    other = (gl.load(flags_ptr + seq) != 0) != CANONICAL
    done = (q_len == 0) | (block_start >= seq_len) | other
    last_pos = gl.minimum(block_start + BLOCK_Q, seq_len) - 1
    first_pos = gl.maximum(block_start, first_query)
    return seq, q_start, first_query, seq_len, block_start, first_pos, last_pos, done


@gluon.jit
def _gather_values(v_dst, vc_ptr, stride_vc, table_ptr, col, start, seq_len,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CACHE_BLOCK: gl.constexpr):  # fmt: skip
    """V of the cached keys ``start ..`` into ``v_dst``, 0 past the sequence: its last block's
    tail and the blocks after it hold whatever an earlier owner left, and a weight of 0 times
    a NaN there is NaN. Eight rows at a time, by the load warp."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for r in gl.static_range(0, BLOCK_N, 8):
        keys = start + r + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
        ok = keys < seq_len
        blocks = gl.load(table_ptr + keys // CACHE_BLOCK, mask=ok, other=0).to(gl.int64)
        slots = (blocks * CACHE_BLOCK + keys % CACHE_BLOCK) * stride_vc + col
        v = gl.load(vc_ptr + gl.expand_dims(slots, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(ok, 1), other=0.0)
        v_dst.slice(r, 8).store(v)


@gluon.jit
def _issue_tile(tile, slot, bar, k_smem, v_smem, loads, last_block, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, CACHE_BLOCK: gl.constexpr):  # fmt: skip
    """Start tile ``tile``'s K and V loads into stage ``slot``, signalled on ``bar``: one TMA
    load each from the chunk's own keys when the tile holds only those (rows past the batch
    read 0), else one per cache block (or per tile of a larger one) through the block table,
    the blocks past the sequence's last reading that one again. A cached tile reaching past
    the sequence has its V gathered instead (``_gather_values``) before ``bar`` is armed."""
    k_desc, v_desc, kc_desc, vc_desc, vc_ptr, stride_vc, table_ptr, col, own_row0, first_own, seq_len, _ = loads
    start = tile * BLOCK_N
    k_dst = k_smem.index(slot)
    v_dst = v_smem.index(slot)
    if start >= first_own:
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [own_row0 + start - first_own, col], bar, k_dst)
        tma.async_copy_global_to_shared(v_desc, [own_row0 + start - first_own, col], bar, v_dst)
    else:
        PIECE: gl.constexpr = kc_desc.block_type.shape[0]
        tail = start + BLOCK_N > seq_len
        if tail:
            _gather_values(v_dst, vc_ptr, stride_vc, table_ptr, col, start, seq_len, BLOCK_N, HEAD_DIM, CACHE_BLOCK)
            fence_async_shared()
            mbarrier.expect(bar, k_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        for b in gl.static_range(BLOCK_N // PIECE):
            key = start + b * PIECE
            block = gl.load(table_ptr + gl.minimum(key // CACHE_BLOCK, last_block))
            row = block * CACHE_BLOCK + key % CACHE_BLOCK
            tma.async_copy_global_to_shared(kc_desc, [row, col], bar, k_dst.slice(b * PIECE, PIECE))
            if not tail:
                tma.async_copy_global_to_shared(vc_desc, [row, col], bar, v_dst.slice(b * PIECE, PIECE))


@gluon.jit
def _loader(loads, k_smem, v_smem, ready, empty, shape):
    """The load partition (one warp): each tile's K/V into the next stage its consumers freed."""
    seq_len = loads[10]
    n_tiles = loads[11]
    HEAD_DIM: gl.constexpr = shape[1]
    BLOCK_N: gl.constexpr = shape[2]
    CACHE_BLOCK: gl.constexpr = shape[3]
    STAGES: gl.constexpr = shape[4]
    last_block = (seq_len - 1) // CACHE_BLOCK
    for j in range(n_tiles):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        _issue_tile(j, slot, ready.index(slot), k_smem, v_smem, loads, last_block, BLOCK_N, HEAD_DIM, CACHE_BLOCK)


@gluon.jit
def _softmax(s, m_i, l_i, pos, tile, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr):  # fmt: skip
    """One tile's fast online-softmax step on scores ``s``: the new max, the sum, the tile's
    weights and the rescale of what came before (the scale folded into the exponent's FMA)."""
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1), s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return m_new, l_i * alpha + gl.sum(p, 1), p, alpha


@gluon.jit
def _canonical_softmax(s, m_i, pos, tile, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
                       s_layout: gl.constexpr):  # fmt: skip
    """One tile's canonical step, ``paged_attention._softmax_step``'s arithmetic operation for
    operation: each score's product with the scale rounded on its own (``mul.rn``, never
    fused), the max, the rescale forced to 1 where the max holds, the weights from the max (0
    where there is none yet). Returns the new max, the weights and the rescale."""
    s = gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [s, gl.full(s.shape, qk_scale, gl.float32,
                                  s_layout)], dtype=gl.float32, is_pure=True, pack=1)  # fmt: skip
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1), s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
    p = gl.exp2(s - gl.expand_dims(gl.where(m_new == -float("inf"), 0.0, m_new), 1))
    return m_new, p, alpha


@gluon.jit
def _merge(m_i, l_i, acc, m_s, l_s, acc_s, o_layout: gl.constexpr):
    """``paged_attention._merge``: a split's state folded into the running one."""
    m_new = gl.maximum(m_i, m_s)
    alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
    beta = gl.where(m_new == m_s, 1.0, gl.exp2(m_s - m_new))
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    b = gl.expand_dims(gl.convert_layout(beta, gl.SliceLayout(1, o_layout)), 1)
    return m_new, l_i * alpha + l_s * beta, acc * a + acc_s * b


@gluon.jit
def _row_sum(weights, ones, ROWS: gl.constexpr):
    """Each row's sum of ``weights`` on the matrix unit (``paged_attention._row_sum``): a
    product with a block of ones, whose equal columns' maximum is the sum. The ones are kept
    ``[SUMS, keys]``, keys contiguous, and read transposed as K is: kept ``[keys, 8]`` (16-byte
    rows, no swizzle), Triton 3.6 gave its wgmma descriptors nonzero base offsets, and rows
    seeing key 32 or later came out wrong (H100, 2026-12-07). Issued asynchronously, to run
    after the product in flight: returns its token and operand, for ``warpgroup_mma_wait``."""
    SUMS: gl.constexpr = ones.shape[0]
    sum_layout: gl.constexpr = _mma_layout(SUMS)
    w = gl.convert_layout(weights, gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2))
    zero = gl.zeros([ROWS, SUMS], gl.float32, sum_layout)
    return warpgroup_mma(w, ones.permute((1, 0)), zero, use_acc=False, is_async=True), w


@gluon.jit
def _first_scores(q_tile, k_smem, ready, turn, zero_s, WG: gl.constexpr):
    """Tile 0's scores, issued in this warpgroup's turn; its product waits to be issued beside
    tile 1's scores."""
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turn.index(WG), 0)
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - WG))
    return warpgroup_mma_wait(0, deps=(s_tok,))


@gluon.jit
def _issue(j, q_tile, k_smem, v_smem, ready, turn, zero_s, p_op, acc, WG: gl.constexpr, STAGES: gl.constexpr):
    """Tile ``j``'s scores and tile ``j - 1``'s product, issued together as asynchronous wgmmas
    in this warpgroup's turn (``turn``: the warpgroups take turns, so one's softmax runs while
    the other's products do). Returns their tokens."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    mbarrier.wait(turn.index(WG), j & 1)
    s_tok = warpgroup_mma(q_tile, k_smem.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), acc, is_async=True)
    mbarrier.arrive(turn.index(1 - WG))
    return s_tok, o_tok


@gluon.jit
def _fast_walk(q_tile, k_smem, v_smem, ready, empty, turn, row_pos, n_tiles, n_full, qk_scale,
               WG: gl.constexpr, shape):  # fmt: skip
    """The fast schedule's walk over a warpgroup's tiles: FlashAttention-3's intra-warpgroup
    overlap (tile ``j``'s ``Q Kⱼᵀ`` and tile ``j - 1``'s ``P V`` issued together as asynchronous
    wgmmas, the softmax of tile ``j`` while ``P V`` runs) inside its ping-pong between the
    warpgroups (``turn``). Returns the weighted values and their sums."""
    HEAD_DIM: gl.constexpr = shape[1]
    BLOCK_N: gl.constexpr = shape[2]
    STAGES: gl.constexpr = shape[4]
    ROWS: gl.constexpr = 64
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    s = _first_scores(q_tile, k_smem, ready, turn, zero_s, WG)
    if n_full > 0:
        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, row_pos, 0, qk_scale, False, BLOCK_N, s_layout)
    else:
        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, row_pos, 0, qk_scale, True, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        s_tok, o_tok = _issue(j, q_tile, k_smem, v_smem, ready, turn, zero_s, p_op, acc, WG, STAGES)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        if j < n_full:
            m_i, l_i, p, alpha = _softmax(s, m_i, l_i, row_pos, j, qk_scale, False, BLOCK_N, s_layout)
        else:
            m_i, l_i, p, alpha = _softmax(s, m_i, l_i, row_pos, j, qk_scale, True, BLOCK_N, s_layout)
        acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(empty.index((j - 1) % STAGES))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc)
    return acc, gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))


@gluon.jit
def _canonical_walk(q_tile, k_smem, v_smem, ones, fold, ready, empty, turn, row_pos, n_tiles, n_full, split_size,
                    qk_scale, WG: gl.constexpr, shape):  # fmt: skip
    """The canonical schedule's walk, in the fast walk's pipeline: tiles at absolute positions,
    ``paged_attention``'s arithmetic (``_canonical_softmax``, the row sum on the matrix unit,
    the rescale before the product), each split of ``split_size`` keys from a fresh state and
    folded into the row's left to right (``_merge``) once its last product is in: after the
    next split's first softmax, which runs from nothing while that product does (folded
    before it, the product was waited for first and 184 bytes a thread spilled). The fold's
    weighted values wait in shared memory (``fold``, ``FOLD_LAYOUT``): in registers beside a
    tile's scores, weights and accumulator they spilled (ptxas, sm_90a: 1,848 bytes a thread).
    Returns the fold's weighted values and sums, the bits of the Triton kernel's."""
    HEAD_DIM: gl.constexpr = shape[1]
    BLOCK_N: gl.constexpr = shape[2]
    STAGES: gl.constexpr = shape[4]
    ROWS: gl.constexpr = 64
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    empty_max = gl.full([ROWS], -float("inf"), gl.float32, row_layout)
    m_f = empty_max
    l_f = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    fold.store(acc)
    m_i = empty_max
    l_i = l_f
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    s = _first_scores(q_tile, k_smem, ready, turn, zero_s, WG)
    if n_full > 0:
        m_i, p, alpha = _canonical_softmax(s, m_i, row_pos, 0, qk_scale, False, BLOCK_N, s_layout)
    else:
        m_i, p, alpha = _canonical_softmax(s, m_i, row_pos, 0, qk_scale, True, BLOCK_N, s_layout)
    weights = p.to(dtype)
    sum_tok, w = _row_sum(weights, ones, ROWS)
    sums, _ = warpgroup_mma_wait(0, deps=(sum_tok, w))
    l_i = l_i * alpha + gl.convert_layout(gl.max(sums, 1), row_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    p_op = gl.convert_layout(weights, p_layout)

    for j in range(1, n_tiles):
        s_tok, o_tok = _issue(j, q_tile, k_smem, v_smem, ready, turn, zero_s, p_op, acc, WG, STAGES)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        # Tile j starts a split: its softmax starts from nothing while tile j - 1's product
        # runs; the last split's state, complete with that product, is folded after.
        fresh = (j * BLOCK_N) % split_size == 0
        m_s = m_i
        if fresh:
            m_i = empty_max
        if j < n_full:
            m_i, p, alpha = _canonical_softmax(s, m_i, row_pos, j, qk_scale, False, BLOCK_N, s_layout)
        else:
            m_i, p, alpha = _canonical_softmax(s, m_i, row_pos, j, qk_scale, True, BLOCK_N, s_layout)
        weights = p.to(dtype)
        sum_tok, w = _row_sum(weights, ones, ROWS)
        acc, sums, _, _ = warpgroup_mma_wait(0, deps=(o_tok, sum_tok, p_op, w))
        mbarrier.arrive(empty.index((j - 1) % STAGES))
        if fresh:
            m_f, l_f, acc_f = _merge(m_f, l_f, fold.load(o_layout), m_s, l_i, acc, o_layout)
            fold.store(acc_f)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
            l_i = gl.zeros([ROWS], gl.float32, row_layout)
        l_i = l_i * alpha + gl.convert_layout(gl.max(sums, 1), row_layout)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        p_op = gl.convert_layout(weights, p_layout)

    acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc)
    m_f, l_f, acc_f = _merge(m_f, l_f, fold.load(o_layout), m_i, l_i, acc, o_layout)
    return acc_f, gl.convert_layout(l_f, o_rows)


@gluon.jit
def _consumer(block, smem, WG: gl.constexpr, shape):
    """One warpgroup's 64 rows of the block (rows ``64 WG ..``): its query tile, its walk over
    the keys in the block's schedule, and its rows of the output."""
    (q_ptr, o_ptr, stride_qn, stride_qh, stride_on, stride_oh, kv_head, q_start, first_query, block_start,
     first_pos, last_pos, n_tiles, qk_scale, split_size) = block
    q_smem, k_smem, v_smem, ones, fold, ready, empty, turn = smem
    GROUP: gl.constexpr = shape[0]
    HEAD_DIM: gl.constexpr = shape[1]
    BLOCK_N: gl.constexpr = shape[2]
    CANONICAL: gl.constexpr = shape[5]
    ROWS: gl.constexpr = 64
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    # Row m is position block_start + m // GROUP, head kv_head * GROUP + m % GROUP; rows outside
    # the chunk repeat its nearest row and are not stored.
    m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout)) + WG * ROWS
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    pos = gl.minimum(gl.maximum(block_start + m // GROUP, first_pos), last_pos)
    q_rows = (q_start + pos - first_query).to(gl.int64) * stride_qn + (kv_head * GROUP + m % GROUP) * stride_qh
    q_tile = q_smem.index(WG)
    q_tile.store(gl.load(q_ptr + gl.expand_dims(q_rows, 1) + gl.expand_dims(d, 0)))
    fence_async_shared()
    gl.thread_barrier()

    row_pos = gl.minimum(gl.maximum(
        block_start + (gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) + WG * ROWS) // GROUP, first_pos),
        last_pos)  # fmt: skip
    # Tiles before this one hold keys every row sees: no mask.
    n_full = (first_pos + 1) // BLOCK_N
    if CANONICAL:
        acc, l_o = _canonical_walk(q_tile, k_smem, v_smem, ones, fold.index(WG), ready, empty, turn, row_pos,
                                   n_tiles, n_full, split_size, qk_scale, WG, shape)  # fmt: skip
    else:
        acc, l_o = _fast_walk(q_tile, k_smem, v_smem, ready, empty, turn, row_pos, n_tiles, n_full, qk_scale, WG,
                              shape)  # fmt: skip

    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    om = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout)) + WG * ROWS
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_pos = block_start + om // GROUP
    keep = (o_pos >= first_pos) & (o_pos <= last_pos)
    o_token = (q_start + gl.minimum(gl.maximum(o_pos, first_pos), last_pos) - first_query).to(gl.int64)
    o_rows = o_token * stride_on + (kv_head * GROUP + om % GROUP) * stride_oh
    gl.store(o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(od, 0), out, mask=gl.expand_dims(keep, 1))


@gluon.jit
def _prefill_kernel(
    q_ptr, o_ptr, stride_qn, stride_qh, stride_on, stride_oh,
    k_desc, v_desc, kc_desc, vc_desc, vc_ptr, stride_vc,
    block_tables_ptr, stride_bt, seq_lens_ptr, query_start_loc_ptr, flags_ptr, num_seqs, qk_scale,
    canonical_split, row_splits,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, CACHE_BLOCK: gl.constexpr,
    STAGES: gl.constexpr, CANONICAL: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """A program: one query block of a sequence of the launch's schedule and one KV head
    (module doc), in three partitions: two consumer warpgroups and a load warp."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    seq, q_start, first_query, seq_len, block_start, first_pos, last_pos, done = _block_of(
        query_start_loc_ptr, seq_lens_ptr, flags_ptr, num_seqs, 128 // GROUP, CANONICAL)
    if done:
        return
    kv_head = gl.program_id(1)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    # The canonical walk's block of ones (``_row_sum``) and its fold's weighted values; a
    # token of each in the fast one.
    SUMS: gl.constexpr = 8
    ONES: gl.constexpr = BLOCK_N if CANONICAL else 16
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
    ones = gl.allocate_shared_memory(dtype, [SUMS, ONES], gl.NVMMASharedLayout.get_default_for([SUMS, ONES], dtype),
                                     gl.full([SUMS, ONES], 1.0, dtype, fill))  # fmt: skip
    fold = gl.allocate_shared_memory(gl.float32, [2, 64, HEAD_DIM if CANONICAL else 8], FOLD_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0))
    fence_async_shared()

    # The canonical split of the block's rows (``paged_attention._sequence_schedule``): grown
    # from ``canonical_split`` until its last row has at most ``row_splits``.
    split_size = canonical_split
    for _ in gl.static_range(8):
        grow = (row_splits > 0) & (last_pos >= row_splits * split_size)
        split_size = gl.where(grow, split_size * 2, split_size)
    n_tiles = (last_pos + BLOCK_N) // BLOCK_N
    table_ptr = block_tables_ptr + seq.to(gl.int64) * stride_bt
    block = (q_ptr, o_ptr, stride_qn, stride_qh, stride_on, stride_oh, kv_head, q_start, first_query, block_start,
             first_pos, last_pos, n_tiles, qk_scale, split_size)
    loads = (k_desc, v_desc, kc_desc, vc_desc, vc_ptr, stride_vc, table_ptr, kv_head * HEAD_DIM, q_start, first_query,
             seq_len, n_tiles)
    shape: gl.constexpr = (GROUP, HEAD_DIM, BLOCK_N, CACHE_BLOCK, STAGES, CANONICAL)
    smem = (q_smem, k_smem, v_smem, ones, fold, ready, empty, turn)
    gl.warp_specialize([
        (_consumer, (block, smem, gl.constexpr(0), shape)),
        (_consumer, (block, smem, gl.constexpr(1), shape)),
        (_loader, (loads, k_smem, v_smem, ready, empty, shape)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGS])


def tma_ready(t: torch.Tensor) -> bool:
    """``t`` ``[rows, kv_heads, head_dim]`` can be read by TMA as ``_descriptor`` sees it."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.data_ptr() | t.stride(0) * t.element_size()) % 16 == 0


def _descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor of ``t`` ``[rows, kv_heads, head_dim]`` seen as ``[rows, kv_heads *
    head_dim]``, loaded ``block_rows`` keys of one head at a time (heads and dimensions must be
    contiguous, rows 16-byte aligned: the engine's views of a QKV projection and its cache are)."""
    rows, heads, dim = t.shape
    if not tma_ready(t):
        raise ValueError(f"TMA needs contiguous heads and 16-byte aligned rows; got strides {t.stride()}")
    return TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], [block_rows, dim],
                            _tile_layout(block_rows, dim, t.dtype))  # fmt: skip


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """Shared-memory layout of a TMA tile: found once, where every layer of every prompt step
    builds four descriptors."""
    return gl.NVMMASharedLayout.get_default_for([rows, dim], _GL_DTYPES[dtype])


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    flags: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    relaunch: Relaunch | None = None,
    canonical: Canonical | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[N, heads, head_dim]`` into ``out`` for the sequences of
    ``seq_lens`` of one schedule: the fast one's (``flags`` 0), or with ``canonical`` the
    canonical one's (``flags`` nonzero), in its tiling; the other sequences' rows are left as
    they are. ``query_start_loc`` may start past row 0. ``k``/``v`` ``[N, kv_heads, head_dim]``
    are the pass's own keys and values, already in the cache. ``relaunch``: a launch site's
    ``Relaunch``, to skip Triton's JIT call when the arguments repeat (every layer of a step)."""
    num_seqs, kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    cache_block = k_cache.shape[1]
    tile = canonical.tile if canonical else BLOCK_N
    piece = min(cache_block, tile)
    grid = (q.shape[0] // (BLOCK_M // group) + 2 * num_seqs, kv_heads)
    caches = [c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache)]
    args = (
        q, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        _descriptor(k, tile), _descriptor(v, tile), *(_descriptor(c, piece) for c in caches),
        v_cache, v_cache.stride(1), block_tables, block_tables.stride(0), seq_lens, query_start_loc, flags, num_seqs,
        scale * LOG2E, canonical.split if canonical else 0, canonical.row_splits if canonical else 0,
    )  # fmt: skip
    constants = dict(GROUP=group, HEAD_DIM=q.shape[-1], BLOCK_N=tile, CACHE_BLOCK=cache_block, STAGES=stages(tile),
                     CANONICAL=canonical is not None, LOADER_REGS=LOADER_REGISTERS[canonical is not None],
                     num_warps=4, maxnreg=LAUNCH_REGISTERS)  # fmt: skip
    (relaunch or Relaunch())(_prefill_kernel, grid, args, constants)
    return out
