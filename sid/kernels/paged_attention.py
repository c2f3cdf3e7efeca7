"""Triton paged attention: varlen, causal, GQA, mixed prefill chunks and decodes in one launch.

Layout and semantics are those of ``sid.kernels.attention_ref`` (the torch references).

One kernel body serves both schedules, chosen per *sequence* (``canonical`` may be one flag
for the batch or one per sequence), so a pass can hold rows of both: a deterministic
request's rows attend canonically beside normal rows (DESIGN 1b). A program owns one *query
block* (``BLOCK_Q`` positions of one sequence, aligned to multiples of ``BLOCK_Q``, times the
``GROUP`` query heads that share one KV head, packed into ``BLOCK_M`` rows so K/V are read once
per KV head) and ``group`` consecutive KV *splits* of its sequence (split ``s`` holds keys
``[s * split_size, (s + 1) * split_size)``). Each split is walked in tiles of ``TILE`` keys
aligned to absolute positions, with an online softmax in increasing tile order, from a fresh
state; the splits' states are then folded left to right (``_merge``). The program that holds
split 0 folds its own splits and writes the rows it completes; every other split's state goes
to a partial buffer, and ``_combine_kernel`` continues the same left fold over them. So a row's
result is the same fold of the same split states however the splits were spread over
programs: the spread (``group``) is free to follow the batch.

* Fast schedule: block shape, tile and split size are chosen from the batch (small BLOCK_M and
  long tiles for decode-only steps; split-KV only when the grid would otherwise leave
  multiprocessors idle, flash-decoding style), one split per program.
* Canonical schedule (DESIGN 3.1): block shape, tile and split size are fixed
  (``CANONICAL_CONFIG``), so a row's arithmetic is a function of its own position and keys
  only. A position always occupies the same row of its query block; tiles and splits sit at
  fixed absolute positions, and tiles past a row's last key are exact no-ops (scores -inf,
  rescale factor forced to 1), so neither the other rows, the query tiling, the number of
  tiles/splits the batch needs, nor prefill-vs-decode can change its bits. The split is short
  (a long context gives a lone sequence many programs), and ``group`` is chosen from the batch:
  a full batch folds all of a row's splits in one program and writes no partials.
  Integer arguments that depend on the batch are not specialised by Triton, so every batch
  runs the same compiled kernel.

When both schedules have the same block shape (decode-only steps), one launch serves a mixed
batch; otherwise the two launch one after the other, each skipping the other's sequences.

Floor: decode attention is memory-bound; a step cannot beat
``(K + V bytes read + Q bytes read + O bytes written) / HBM bandwidth``, i.e. per sequence
``2 * seq_len * kv_heads * head_dim * cache bytes`` plus ``2 * q_rows * heads * head_dim *
q bytes``, over ~3.7 TB/s on the H200 (Llama-3.1-8B, bf16, 8192 keys: 32 MiB, ~9 us per
sequence and layer). Split-KV partials add ``q_rows * heads * splits * (head_dim + 2) * 8``
bytes. Prefill is bound by its FLOPs, ``4 * q_rows * heads * head_dim * keys / 2`` (causal),
over the measured bf16 matmul rate (~790 TFLOP/s). Measured on the H200 before per-sequence
schedules (benchmarks/attention.py, CUDA graphs, 2026-11-29): the fast schedule reaches
0.9-1.0 of the floor from 32 x 8192 or 128 x 2048 (batch x context) up, the canonical one
0.80-0.86 (Llama-3.1-8B, GQA 4) and 0.66-0.68 (Qwen3-0.6B, GQA 2); single-digit batches are
latency-bound (16-50 us per layer). Prefill (8 x 2048) runs at ~225 TFLOP/s fast and ~120
canonical, a third of the bf16 matmul rate or less.
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
    "prefill_block_m": 32,
    "kv_tile": 128,
    "kv_split": 512,
    "num_warps": 4,
    "num_stages": 3,
}
"""Fixed launch constants of the canonical schedule; part of the numerics fingerprint.

``block_m`` is raised to the next power of two of the GQA group when the group is larger
(a function of the model, never of the batch). A step with prompt rows (a query longer than
one token) takes ``prefill_block_m`` instead, 1.5x quicker there: with 4 warps both shapes
multiply on the same matrix instructions (mma.sync; 64 rows and more take wgmma, whose rows
round differently) and gave every row the same bits on the H200, which the kernel tests and
the start-up self-test check, since a row may be computed in either. Tiles sit at multiples of ``kv_tile``
absolute positions, split boundaries at multiples of ``kv_split``. The block shape was chosen
on the H200 by ``benchmarks/canonical_sweep.py`` (block_m 16 decodes as fast as the fast
schedule; 64 is twice as slow there). The split is short so that one long sequence spreads
over the multiprocessors (32k keys: 64 splits per KV head); how many splits one program
folds is chosen from the batch, so a full batch pays no partials for it.
"""

_COMBINE_NUM_WARPS = 4
_COMBINE_PREFETCH = 8
"""Splits whose partials the combine kernel loads at once (an unrolled step of its fold)."""
_COMBINE_DIMS = 32
"""Head dimensions one combine program folds when the batch leaves multiprocessors idle: a
lone row's partials spread over several programs. A full batch keeps one program per head,
so each program's fixed work (finding its sequence and schedule) is not paid several times."""
_FAST_MIN_SPLIT_KEYS = 256
"""Fast schedule: a split is never shorter than this, so the partials stay cheap."""
_FAST_MAX_SPLITS = 32
"""Fast schedule: a row never has more splits than this. The combine folds a row's splits one
after another (~0.25 us each on the H200), so beyond this more splits cost more than the
parallelism they add (batch 1 at 32k keys: 68 us with 64 splits, 51 with 32)."""
_PROGRAMS_PER_SM = 4
"""Split-KV spreads a batch until about this many programs per multiprocessor."""
_NOMINAL_SMS = 8
"""Stand-in multiprocessor count off CUDA (the interpreter), so CPU runs exercise split-KV."""
_SERVE_FAST, _SERVE_CANONICAL = 1, 2
"""Bits of a launch's ``serve``: which sequences' schedule it runs."""


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
    """A launch's constants: block shape, tile, split size, and how many splits a program folds."""

    block_m: int
    kv_tile: int
    split_size: int
    num_warps: int
    num_stages: int
    group: int = 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """What the compiled kernel depends on: schedules of one shape can share a launch."""
        return self.block_m, self.kv_tile, self.num_warps, self.num_stages


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


@triton.jit
def _merge(m_i, l_i, acc, m_s, l_s, acc_s):
    """Fold a split's state into the running one: the single combine formula of both kernels,
    so a fold gives the same bits whichever kernel performs it. A state with no keys
    (``m`` = -inf, ``l`` = 0) is an exact no-op on either side."""
    m_new = tl.maximum(m_i, m_s)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
    beta = tl.where(m_new == m_s, 1.0, tl.exp2(m_s - m_new))
    return m_new, l_i * alpha + l_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]


@triton.jit
def _sequence_schedule(canonical_ptr, seq, serve, fast_split, canonical_split, canonical_group):
    """(served by this launch, split size, splits per program) of sequence ``seq``."""
    canonical = tl.load(canonical_ptr + seq) != 0
    served = (serve & tl.where(canonical, 2, 1)) != 0
    split_size = tl.where(canonical, canonical_split, fast_split)
    group = tl.where(canonical, canonical_group, 1)
    return served, split_size, group


@triton.jit(
    do_not_specialize=["num_seqs", "serve", "fast_split", "canonical_split", "canonical_group", "num_slots", "stride_bt"]
)
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
    canonical_ptr,
    qk_scale,
    num_seqs,
    serve,
    fast_split,
    canonical_split,
    canonical_group,
    num_slots,
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
    """Online-softmax attention of one query block over its ``group`` splits (see the module doc)."""
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q
    )
    if done:
        return
    served, split_size, group = _sequence_schedule(
        canonical_ptr, seq, serve, fast_split, canonical_split, canonical_group
    )
    first = tl.program_id(2) * group
    if (~served) | (first * split_size > last_pos):
        return
    stop = tl.minimum(first + group, last_pos // split_size + 1)
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
    part = (token * tl.num_programs(1) * GROUP + head) * num_slots
    m_f = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_f = tl.zeros([BLOCK_M], tl.float32)
    acc_f = tl.zeros([BLOCK_M, DIM], tl.float32)
    for split in range(first, stop):
        split_start = split * split_size
        kv_stop = tl.minimum(split_start + split_size, last_pos + 1)
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
            # A row with no key yet in this split (a later split of a short row that split 0's
            # program folds) keeps an empty state: no NaN from -inf - -inf.
            p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=precision)
            m_i = m_new
        if first == 0:
            m_f, l_f, acc_f = _merge(m_f, l_f, acc_f, m_i, l_i, acc)
        else:
            reach = valid & (pos >= split_start)
            tl.store(part_max_ptr + part + split, m_i, mask=reach)
            tl.store(part_sum_ptr + part + split, l_i, mask=reach)
            tl.store(
                part_acc_ptr + (part + split)[:, None] * DIM + dims[None, :], acc, mask=reach[:, None] & dim_ok[None, :]
            )
    if first == 0:
        complete = pos // split_size < stop
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
            (acc_f / l_f[:, None]).to(out_ptr.dtype.element_ty),
            mask=(valid & complete)[:, None] & dim_ok[None, :],
        )
        # Rows with splits beyond this program leave their fold so far in slot 0.
        partial = valid & ~complete
        tl.store(part_max_ptr + part, m_f, mask=partial)
        tl.store(part_sum_ptr + part, l_f, mask=partial)
        tl.store(part_acc_ptr + part[:, None] * DIM + dims[None, :], acc_f, mask=partial[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "serve", "fast_split", "canonical_split", "canonical_group", "num_slots"])
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    canonical_ptr,
    num_seqs,
    serve,
    fast_split,
    canonical_split,
    canonical_group,
    num_slots,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
    DIMS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Continue the left fold of the rows that split 0's program left unfinished: its fold in
    slot 0, then every later split's state, in increasing split order. A program folds
    ``DIMS`` of the head dimensions (the third grid axis): the fold is elementwise, so this
    spreads a lone long row's partials over more multiprocessors without changing a bit."""
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q
    )
    if done:
        return
    served, split_size, group = _sequence_schedule(
        canonical_ptr, seq, serve, fast_split, canonical_split, canonical_group
    )
    block_splits = last_pos // split_size + 1
    if (~served) | (block_splits <= group):
        return
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    dim_ok = dims < HEAD_DIM
    row_splits = pos // split_size + 1
    rows = valid & (row_splits > group)
    part = (token * tl.num_programs(1) * GROUP + head) * num_slots
    m_i = tl.load(part_max_ptr + part, mask=rows, other=0.0)
    l_i = tl.load(part_sum_ptr + part, mask=rows, other=1.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM + dims[None, :], mask=rows[:, None] & dim_ok[None, :], other=0.0)
    # Unrolled by PREFETCH so the loads of several splits are in flight at once: the fold is
    # serial, its loads are not (a lone long row has dozens of splits).
    for base in range(group, block_splits, PREFETCH):
        for i in tl.static_range(PREFETCH):
            live = rows & (base + i < row_splits)
            m_s = tl.load(part_max_ptr + part + base + i, mask=live, other=float("-inf"))
            l_s = tl.load(part_sum_ptr + part + base + i, mask=live, other=0.0)
            acc_s = tl.load(
                part_acc_ptr + (part + base + i)[:, None] * DIM + dims[None, :],
                mask=live[:, None] & dim_ok[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
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


@functools.lru_cache(maxsize=None)
def _uniform_flags(device: torch.device, canonical: bool, length: int) -> torch.Tensor:
    """Per-sequence schedule flags of a batch that runs one schedule (lengths are powers of two)."""
    return torch.full((length,), int(canonical), dtype=torch.int32, device=device)


def _target_programs(device: torch.device) -> int:
    return _PROGRAMS_PER_SM * _num_sms(device)


def _query_blocks(num_tokens: int, num_seqs: int, max_query_len: int, block_q: int) -> int:
    """Query blocks holding rows: what the grid's first axis offers before any split."""
    return min(num_seqs * triton.cdiv(max_query_len, block_q), num_tokens // block_q + num_seqs)


def _canonical_schedule(
    group: int, num_tokens: int, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> _Schedule:
    """The fixed canonical constants (a function of the model's GQA group only), and how many
    of a row's splits one program folds: all of them once the batch alone fills the GPU."""
    cfg = CANONICAL_CONFIG
    block_m = max(cfg["block_m"] if max_query_len == 1 else cfg["prefill_block_m"], triton.next_power_of_2(group))
    programs = _query_blocks(num_tokens, num_seqs, max_query_len, block_m // group) * num_kv_heads
    splits = triton.cdiv(max_seq_len, cfg["kv_split"])
    spread = max(1, _target_programs(device) // programs)
    return _Schedule(
        block_m=block_m,
        kv_tile=cfg["kv_tile"],
        split_size=cfg["kv_split"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        group=triton.cdiv(splits, spread),
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
    programs = _query_blocks(num_tokens, num_seqs, max_query_len, block_m // group) * num_kv_heads
    splits = max(1, min(triton.cdiv(_target_programs(device), programs), max_seq_len // _FAST_MIN_SPLIT_KEYS, _FAST_MAX_SPLITS))
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
    canonical: bool | torch.Tensor,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    schedules: tuple[bool, bool] | None = None,
) -> torch.Tensor:
    """Causal varlen paged attention of ``q`` ``[N, heads, head_dim]`` over the cache.

    Semantics of ``paged_attention_ref`` (fast) / ``paged_attention_canonical_ref``
    (canonical, bit-stable per row), chosen per sequence: ``canonical`` is one flag for the
    batch, or an int32 ``[S]`` tensor of per-sequence flags. With per-sequence flags,
    ``schedules`` = (any fast sequence, any canonical one) saves a launch; None means both may
    be present. ``max_query_len`` / ``max_seq_len`` are host copies of the batch maxima; pass
    them to keep the launch free of device syncs. Returns ``out`` (allocated if None).
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
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if isinstance(canonical, torch.Tensor):
        flags, (any_fast, any_canonical) = canonical, schedules or (True, True)
    else:
        flags = _uniform_flags(q.device, canonical, triton.next_power_of_2(num_seqs))
        any_fast, any_canonical = not canonical, canonical
    shape = (num_tokens, num_seqs, num_kv_heads, max_query_len, max_seq_len, q.device)
    fast = _fast_schedule(num_tokens, num_seqs, group, *shape[2:]) if any_fast else None
    canon = _canonical_schedule(group, *shape) if any_canonical else None
    # Per schedule: its splits per row, and whether its programs leave partials for the combine.
    splits = {s: triton.cdiv(max_seq_len, s.split_size) for s in (fast, canon) if s is not None}
    slots = max([n for s, n in splits.items() if n > s.group] or [1])
    if slots > 1:
        part_acc = torch.empty((num_tokens, num_heads, slots, max(16, triton.next_power_of_2(head_dim))),
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_heads, slots), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = _unused_partials(q.device)
    args = (
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, block_tables, seq_lens, query_start_loc, flags,
        fast.split_size if fast is not None else 1, canon.split_size if canon is not None else 1,
        canon.group if canon is not None else 1, slots, scale, block_size, group, head_dim,
    )
    if fast is not None and canon is not None and fast.shape == canon.shape:
        programs = max(-(-n // s.group) for s, n in splits.items())
        _launch(*args, fast, _SERVE_FAST | _SERVE_CANONICAL, programs, slots > 1)
    else:
        for sched, serve in ((fast, _SERVE_FAST), (canon, _SERVE_CANONICAL)):
            if sched is not None:
                n = splits[sched]
                _launch(*args, sched, serve, -(-n // sched.group), n > sched.group)
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    flags: torch.Tensor,
    fast_split: int,
    canonical_split: int,
    canonical_group: int,
    slots: int,
    scale: float,
    block_size: int,
    group: int,
    head_dim: int,
    sched: _Schedule,
    serve: int,
    programs: int,
    combine: bool,
) -> None:
    """One attention launch over the sequences of the schedules in ``serve`` (``programs`` per
    query block and KV head along the keys), and the combine of their partials."""
    num_tokens, num_seqs, num_kv_heads = q.shape[0], seq_lens.shape[0], k_cache.shape[2]
    block_q = sched.block_m // group
    dim = max(16, triton.next_power_of_2(head_dim))
    grid = (num_tokens // block_q + 2 * num_seqs, num_kv_heads)
    _attention_kernel[(*grid, programs)](
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
        flags,
        scale * 1.4426950408889634,
        num_seqs,
        serve,
        fast_split,
        canonical_split,
        canonical_group,
        slots,
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
    if combine:
        dims = _COMBINE_DIMS if (num_tokens // block_q + num_seqs) * num_kv_heads < _target_programs(q.device) else dim
        _combine_kernel[(*grid, triton.cdiv(dim, dims))](
            out,
            part_acc,
            part_max,
            part_sum,
            seq_lens,
            query_start_loc,
            flags,
            num_seqs,
            serve,
            fast_split,
            canonical_split,
            canonical_group,
            slots,
            *out.stride(),
            GROUP=group,
            BLOCK_M=sched.block_m,
            BLOCK_Q=block_q,
            HEAD_DIM=head_dim,
            DIM=dim,
            DIMS=min(dim, dims),
            PREFETCH=_COMBINE_PREFETCH,
            num_warps=_COMBINE_NUM_WARPS,
        )
