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
to a partial buffer, and the same left fold continues over them: in a decode launch the last
of a block's programs to finish folds them (``_fold_if_last``), after a prompt launch
``_combine_kernel`` does. So a row's result is the same fold of the same split states however
the splits were spread over programs: the spread (``group``) is free to follow the batch.

* Fast schedule: block shape, tile and how many programs share a sequence's keys are chosen
  from the batch (small BLOCK_M and long tiles for decode-only steps; split-KV only when the
  grid would otherwise leave multiprocessors idle, flash-decoding style), one split per
  program; each sequence cuts its own keys into that many splits (``_fast_split``), so a
  launch sized for longer sequences (a CUDA graph's) still spreads a short one.
* Canonical schedule (DESIGN 3.1): block shape, tile and split size are fixed
  (``CANONICAL_CONFIG``), so a row's arithmetic is a function of its own position and keys
  only. A position always occupies the same row of its query block; tiles and splits sit at
  fixed absolute positions, and tiles past a row's last key are exact no-ops (scores -inf,
  rescale factor forced to 1), so neither the other rows, the query tiling, the number of
  tiles/splits the batch needs, nor prefill-vs-decode can change its bits. The split is short
  (a long context gives a lone sequence many programs), and how many programs share a
  sequence's splits is chosen from the batch: at least the target's programs for a thin
  batch, and once a decode batch gives every multiprocessor a program, at least 1,024 keys a
  program, as in the fast schedule (a full batch folds all of a row's splits in one program
  and writes no partials). Each sequence deals its own splits out to those programs
  (``group`` consecutive splits each), so a short one in a launch sized for longer ones, a
  CUDA graph's, still gets several. A program walks its splits' tiles in one
  software-pipelined loop a kind of tile, finishing each split at its last tile
  (``_decode_splits``, ``_attend_splits``), so the loads do not drain at split boundaries.
  Integer arguments that depend on the batch are not specialised by Triton, so every batch
  runs the same compiled kernel.

A mixed decode batch is one launch: the two schedules' decode constants (block shape, tile,
warps, stages) are the same, each sequence reads its own split size and group, and the launch
is compiled with the canonical row sum (``MATRIX_SUM``, a compile-time constant). Over many
sequences each decode program takes or skips it by its sequence's flag, a branch around the row
sum alone (fast rows keep ``tl.sum``); a launch over few sequences sums every row on the matrix
unit (``_SUM_BY_SEQUENCE_FROM``). On the H200 (Qwen3-0.6B and Llama-3.1-8B heads, 2026-12-05)
the branch made a launch of 64 / 256 rows of 200-1,500 keys 6-8 / 5-7 % quicker than the
matrix-unit sum for every row, whether none, 1 in 50 or every row was canonical, and 64 rows of
8,192 keys 3-5 %; at 8 / 16 rows of 200-1,500 keys and 1-32 rows of 8,192 keys it was 0-6 %
slower. A second launch beside the first cost a riding Qwen3-0.6B decode step 0.28-0.34 ms (28
layers; H200, whole-step graphs, batch 16 / 64 / 256: +14 / +10 / +5 %) even with no canonical
row, where the proven GEMMs cost nothing (2026-12-02). A mixed batch with prompt rows, whose
schedules differ in block shape and arithmetic, launches them separately, each skipping the
other's sequences. A step's decodes beside prompt rows (its first sequences, ``num_decodes``)
get a decode-shaped launch of their own, whose one launch serves both schedules, and the prompt
launches cover the sequences after them: in a 128-row prompt block a decode row costs a block's
work. On CUDA the canonical launch goes first, on a side stream, and runs beside the fast one:
a few canonical sequences are a latency-bound tail when a full batch gives each one program for
all its splits, and after the fast launch that tail added its whole length.

Steps with prompt rows (the prefill work):

* Keys come from two places. The cache holds every key, the step's own already stored; a
  sequence's keys before its first query row (its cached prefix) are gathered through the
  block table, and when the caller passes the step's own ``k``/``v`` the keys from that row
  on are read from them, whole tiles of consecutive rows (TMA descriptor loads in both
  schedules on sm_90 and later). The values are the cache's, so nothing changes but the loads.
* Causal block skipping: the tiles every row of a query block sees whole run without the
  mask; only the one or two diagonal tiles apply it. A mask that hides nothing is an identity,
  and the canonical arithmetic rounds each score on its own (``_rounded_product``) so that the
  compiler cannot fuse it differently in the two kinds of tile: a row keeps its bits.
* The fast schedule gives each program one split, so a program carries one softmax state
  (not a split's beside its fold), and folds the scale into the exponent's FMA.
* On sm_90, with ``SID_HOPPER_PREFILL=1`` (``HOPPER_PREFILL``), a prompt launch of either
  schedule whose query blocks fill the multiprocessors without spreading splits over programs
  runs as ``hopper_prefill``'s Gluon kernel instead (``_hopper_prompt``): the same blocks and
  semantics, with FlashAttention-3's warp specialisation and softmax overlap written out. A
  canonical launch's rows keep this kernel's bits (``hopper_canonical``).

Floor: decode attention is memory-bound; a step cannot beat
``(K + V bytes read + Q bytes read + O bytes written) / HBM bandwidth``, i.e. per sequence
``2 * seq_len * kv_heads * head_dim * cache bytes`` plus ``2 * q_rows * heads * head_dim *
q bytes``, over ~3.7 TB/s on the H200 (Llama-3.1-8B, bf16, 8192 keys: 32 MiB, ~9 us per
sequence and layer). Split-KV partials add ``q_rows * heads * splits * (head_dim + 2) * 8``
bytes. Prefill is bound by its FLOPs, per sequence ``4 * heads * head_dim * (chunk * prefix +
chunk * (chunk + 1) / 2)`` (a chunk of ``chunk`` rows after ``prefix`` cached keys, causal),
over the measured bf16 matmul rate (~790 TFLOP/s; 693-765 in other runs): 8 x 2048 with
Llama-3.1-8B's heads is 2.75e11 FLOP, 0.35 ms a layer at 790. Measured on the H200 before
per-sequence schedules (benchmarks/attention.py, CUDA graphs, 2026-11-29): the fast schedule reaches
0.9-1.0 of the floor from 32 x 8192 or 128 x 2048 (batch x context) up, the canonical one
0.80-0.86 (Llama-3.1-8B, GQA 4) and 0.66-0.68 (Qwen3-0.6B, GQA 2); single-digit batches are
latency-bound (16-50 us per layer). Prefill before the chunk's own keys were read contiguously
and the visible tiles unmasked (2026-12-01, 16-call graphs): 8 x 2048 at 202 TFLOP/s fast and
109 canonical, 2 x 8192 at 242 / 124, 1 x 32768 at 259 / 129, 0.29-0.37 of the matmul rate fast.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from sid.kernels import hopper_prefill
from sid.kernels.launch import Relaunch

CANONICAL_CONFIG: dict[str, int] = {
    "block_m": 16,
    "prefill_block_m": 128,
    "kv_tile": 128,
    "kv_split": 256,
    "row_splits": 48,
    "num_warps": 4,
    "prefill_num_warps": 8,
    "num_stages": 3,
}
"""Fixed launch constants of the canonical schedule; part of the numerics fingerprint.

``block_m`` is raised to the next power of two of the GQA group when the group is larger
(a function of the model, never of the batch). A step with prompt rows (a query longer than
one token) takes ``prefill_block_m`` rows on ``prefill_num_warps`` warps instead: 128-row
blocks multiply on wgmma where 16-row decode blocks take mma.sync, and a row gets the same
bits from both because the only sum whose order the block shape could change, a row's sum of
its weights, is taken on the matrix unit too (``_row_sum``; with ``tl.sum`` one row in ~40
moved by a bf16 ulp between the two). Measured on the H200 (2026-12-01): every position of a
4,096-token prompt, GQA 4 and 2, the same bits as a 128-row prompt block, in two chunks, and
as a lone decode row; 1 x 32k prefill 32.3 ms a layer against 57.8 in 32-row blocks. The
kernel tests and the start-up self-test check it on every machine. Tiles sit at multiples of
``kv_tile`` absolute positions. The decode block shape was chosen on the H200 by
``benchmarks/canonical_sweep.py`` (block_m 16 decodes as fast as the fast schedule; 64 rows on
wgmma decode 1.5-2.3x slower).

Splits sit at multiples of a size that grows with the row's position: ``kv_split``, doubled
until the row has at most ``row_splits`` splits (``_canonical_split``). A short row gets short
splits, so a lone sequence still spreads over several programs, and a long one no more than
``row_splits``, which the combine folds one after another. On the H200 (Qwen3-0.6B heads, a
lone row, a layer; 2026-12-02): 1,024-key splits decoded 32k keys in 47.9 us against 55.0 for
512 (fast 45.3); 256-key ones decoded 800 keys in 12.2 us against 17.0 (fast 11.9), 8 x 1,000
in 16.3 against 22.0 (fast 15.6). A canonical prefill in 256-key splits took 1.2-1.3x its time
in 512 while each split ran its own tile loops (sixteenth session); walked in one loop the two
sizes prefill alike (1 x 8,192: 937 / 943 us). The size changes at ``row_splits * kv_split *
2**k`` keys, multiples of every query block, so the rows of a block share it. How many splits
one program folds is chosen from the batch, so a full batch pays no partials.
"""

FAST_PREFILL_CONFIG: dict[str, int] = {
    "block_m": 128,
    "kv_tile": 64,
    "num_warps": 8,
    "num_stages": 3,
}
"""Launch constants of the fast schedule in steps with prompt rows (``block_m`` is raised to
the GQA group's power of two when larger). 128-row blocks of 64-key tiles on 8 warps were the
quickest shape on the H200 before the chunk's own keys were read contiguously (8 x 2k: 1.37 ms
against 1.51 for 128-key tiles, 2.38 for 4 warps)."""

FAST_DECODE_TILE = 128
"""Keys of a fast decode tile: the canonical schedule's ``kv_tile``, so a decode step with rows
of both schedules is one launch (``plan_attention``)."""

HOPPER_PREFILL = os.environ.get("SID_HOPPER_PREFILL") == "1"
"""Prompt launches run as ``hopper_prefill``'s Gluon kernel where they can (``_hopper_prompt``):
with ``SID_HOPPER_PREFILL=1`` in the environment (the TP workers inherit it). Off by default
until the engine's throughput with it is measured. On an H100 (2026-12-07, 33b44c0) its fast
schedule matched the reference and its canonical one gave every row the Triton kernel's bits
in their kernel tests (GQA 1-8, head_dim 64/128, cache blocks 16/128, NaN-poisoned caches),
and they reached, as fractions of the bf16 matmul rate against the Triton launches' (16-call
CUDA graphs; Llama-3.1-8B heads; fast, then canonical): 8 x 2k 0.59 / 0.49 and 0.46 / 0.35,
2 x 8k 0.74 / 0.66 and 0.55 / 0.49, 1 x 32k 0.76 / 0.71 and 0.60 / 0.56, a 2k chunk after 16k
cached keys 0.74 / 0.40 and 0.49 / 0.40 (Qwen3-0.6B heads within 0.03 of these)."""

_COMBINE_NUM_WARPS = 4
_COMBINE_PREFETCH = 8
"""Splits whose partials a combine program loads at once, all before it
folds the first (H200, Qwen3-0.6B heads, a lone row: 32k keys 55.0 us a layer against 65.1
when each split's loads sat beside its fold; 2026-12-02)."""
_FOLD_PREFETCH = 32
"""Splits a decode launch's last program loads at once to fold a block's partials
(``_fold_if_last``): a fast row's every split (``_FAST_MAX_SPLITS``), so one round trip.
Its states hold the block's GQA group alone, not the 16 rows of the block, so 32 fit in
registers (ptxas, sm_90a: no spills in either schedule)."""
_COMBINE_PREFETCH_ELEMENTS = _COMBINE_PREFETCH * 16 * 128
"""Partial values a combine program holds in flight at most: a 128-row prompt block's program
prefetches fewer splits (eight of its 64 KB states spilled: 4 x 512 fast prefill 137 us
against 52)."""
_COMBINE_DIMS = 32
"""Head dimensions one combine program of a prompt launch folds (``_combine_kernel``)."""
_SPLIT_DOUBLINGS = tl.constexpr(8)
"""How often a canonical split size may double (``CANONICAL_CONFIG`` ``row_splits``): 256 keys
grow to 65,536 at most, whose 48 splits hold 3.1M keys, past any context Sid serves."""
_MIN_PROGRAM_KEYS = 256
"""A program walks at least this many of a sequence's keys (a fast split, a canonical group of
splits), so the partials stay cheap."""
_FULL_MIN_PROGRAM_KEYS = 1024
"""The same, once a decode batch gives every multiprocessor a program: splitting then only
pays on long sequences (H200, Qwen3-0.6B decode steps at ~800 keys, batch 32: 2.45 ms with
three 256-key fast splits, 2.21 with one; canonical attention at batch 32 and ~1,000 keys,
two 512-key splits on two programs: 47.6 us a layer against the fast 39.8)."""
_FAST_MAX_SPLITS = 32
"""Fast schedule: a row never has more splits than this. The combine folds a row's splits one
after another (~0.25 us each on the H200), so beyond this more splits cost more than the
parallelism they add (batch 1 at 32k keys: 68 us with 64 splits, 51 with 32)."""
_PROGRAMS_PER_SM = 4
"""Split-KV spreads a batch until about this many programs per multiprocessor."""
_DECODE_PROGRAMS_AT_ONCE = 2
"""Decode programs a multiprocessor runs at once: a bf16 one asks for 78 KB of sm_90's 227 KB
of shared memory, and its 128 threads 227-255 registers each, half of the 64K
(``tests/sm90_shared_memory.py``). A fast decode launch's splits are chosen by the waves of
programs this gives (``_decode_spread``)."""
_NOMINAL_SMS = 8
"""Stand-in multiprocessor count off CUDA (the interpreter), so CPU runs exercise split-KV."""
_DECODE_LAUNCH_FROM = 16
"""One-row sequences beside prompt rows get a decode launch of their own from this many on
(``paged_attention``'s ``num_decodes``). Below it the second launch's host time outweighs
what it saves the GPU (H200, Qwen3-0.6B heads, a layer in a 16-call graph: 1 x 500 prompt
rows beside 4 decodes of 700 keys 34.1 us in one launch and 32.7 in two, beside 8 of 300 keys
18.1 and 22.0, beside 16 of 700 keys 67.3 and 42.5; the second launch adds 50-100 us of host
time, which a small model's eager prompt step pays in full). Since a step's later layers launch
directly (``Relaunch``), a launch costs them 17-44 us (2026-12-04); the threshold was not
measured again."""
_SERVE_FAST, _SERVE_CANONICAL = 1, 2
"""Bits of a launch's ``serve``: which sequences' schedule it runs."""
_SERVE_BOTH = _SERVE_FAST | _SERVE_CANONICAL
_SUM_BY_SEQUENCE_FROM = 64
"""A decode launch serving both schedules over at least this many sequences branches on each
one's flag around the row sum (``BY_SEQUENCE``); a smaller one sums every row on the matrix
unit, fast rows too. Canonical rows get the same bits either way. The branch won at 64 and 256
sequences and lost at 1-32 (module doc); 33-63 were not measured."""
_TICKETS = 1 << 16
"""Query blocks x KV heads a decode launch may have for its programs to fold their own
partials (``_fold_if_last``); a larger one leaves them to the combine kernel."""


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
    prompt: bool = False
    """The step has prompt rows: tiles every row of a block sees whole skip the causal mask."""
    fast_prefill: bool = False
    """Fast schedule with prompt rows: one split per program, the scale folded into the exponent."""
    min_keys: int = 0
    """The fewest keys a program walks: a fast split's least size (``_fast_split``), a
    canonical group's least span."""
    max_splits: int = 1
    """The most splits a row of the launch has: its partial slots."""
    row_splits: int = 0
    """Canonical: the most splits a row has before its split size doubles (``_row_splits``)."""
    hopper: bool = False
    """Prompt launch run by ``hopper_prefill`` (``_hopper_prompt``): a block's splits in one program."""



@triton.jit
def _find_seq(query_start_loc_ptr, row0, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning ``q_block``: the last s with ``r(s) // BLOCK_Q + 2 * s <= q_block``, where
    ``r(s) = query_start_loc[s] - row0`` counts rows from the launch's first.

    Sequence s owns blocks ``[r(s) // BLOCK_Q + 2s, r(s + 1) // BLOCK_Q + 2s + 2)``: at least
    ``q_len // BLOCK_Q + 2``, enough for its rows in position-aligned blocks. So a grid of
    ``N // BLOCK_Q + 2S`` blocks covers every row without reading lengths on the host; surplus
    blocks exit at once.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if (tl.load(query_start_loc_ptr + mid) - row0) // BLOCK_Q + 2 * mid <= q_block:
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
    DECODE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr = False,
):
    """Rows of this program's query block: sequence, flat token, head, validity and position.

    Blocks are aligned to absolute positions: block ``j`` of a sequence holds positions
    ``[j * BLOCK_Q, (j + 1) * BLOCK_Q)``, and row ``m`` is position ``j * BLOCK_Q + m // GROUP``,
    head ``kv_head * GROUP + m % GROUP``. A position therefore always sits in the same row of
    the tile, whatever the batch (matrix units need not treat every row alike). Rows that are
    not this step's queries are padding: they repeat a valid row and are never stored.
    ``DECODE``: every sequence has one row at most, so block ``s`` is sequence ``s``'s (a grid
    of one block a sequence; no search). ``query_start_loc`` may start past row 0 (the later
    sequences of a step, ``paged_attention``'s ``num_decodes``): blocks count from its first
    row, tokens are the step's. Returns (sequence, done, flat token, head, valid, position,
    last valid position).

    ``LONGEST_FIRST``: blocks are numbered from the last. A causal block's work grows with its
    position and the multiprocessors take programs in grid order, so the longest blocks go
    first and the short ones fill the gaps at the end instead of a few long ones running alone:
    the fast prompt launch (H200, Qwen3-0.6B / Llama-3.1-8B heads, 16-call graphs: 1 x 8,192
    0.90x its time in grid order, 1 x 32,768 0.97-0.98x, 8 x 2,048 0.98-0.99x). The canonical
    prompt launch keeps grid order: it took 1.03x at 8 x 2,048 and 1.055x at 1 x 32,768 so.
    """
    q_block = tl.num_programs(0) - 1 - tl.program_id(0) if LONGEST_FIRST else tl.program_id(0)
    if DECODE:
        seq = q_block
    else:
        row0 = tl.load(query_start_loc_ptr)
        seq = _find_seq(query_start_loc_ptr, row0, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query = seq_len - q_len
    if DECODE:
        block_start = first_query // BLOCK_Q * BLOCK_Q
    else:
        block_start = (first_query // BLOCK_Q + q_block - (q_start - row0) // BLOCK_Q - 2 * seq) * BLOCK_Q
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
def _sequence_schedule(
    canonical_ptr, seq_lens_ptr, seq, last_pos, serve, fast_programs, min_keys, canonical_split, canonical_row_splits,
    canonical_programs, TILE: tl.constexpr,
):  # fmt: skip
    """(canonical, served by this launch, split size, splits per program) of the query block of
    sequence ``seq`` whose last row is at ``last_pos``. Each sequence spreads its own keys over
    the launch's programs along the keys: a fast one cuts them into ``fast_programs`` splits
    (``_fast_split``), a canonical block deals its splits out to ``canonical_programs`` programs,
    so a short sequence beside a long one, or in a graph launched for the model's longest, is
    not walked by a single program. A canonical split's size is a function of the row's
    position alone (``_canonical_split``; ``canonical_row_splits`` 0: a fixed size); every row
    of a block has the same."""
    canonical = tl.load(canonical_ptr + seq) != 0
    served = (serve & tl.where(canonical, 2, 1)) != 0
    keys = tl.load(seq_lens_ptr + seq)
    fast_split = tl.maximum(tl.cdiv(tl.cdiv(keys, fast_programs), TILE) * TILE, min_keys)
    canonical_size = canonical_split
    for _ in tl.static_range(_SPLIT_DOUBLINGS):  # unrolled, branch-free
        grow = (canonical_row_splits > 0) & (last_pos >= canonical_row_splits * canonical_size)
        canonical_size = tl.where(grow, canonical_size * 2, canonical_size)
    split_size = tl.where(canonical, canonical_size, fast_split)
    least = tl.cdiv(min_keys, canonical_size)
    group = tl.where(canonical, tl.maximum(tl.cdiv(last_pos // canonical_size + 1, canonical_programs), least), 1)
    return canonical, served, split_size, group


@triton.jit
def _rounded_product(x, y, INTERPRET: tl.constexpr):
    """``x * y`` rounded on its own. A plain product may be fused into the subtraction that
    follows it (one rounding instead of two) where no mask stands between them, so a fully
    visible tile would give a row other bits than a masked one; ``mul.rn`` is never fused."""
    if INTERPRET:
        return x * y
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row_sum(weights, precision: tl.constexpr):
    """Each row's sum of ``weights``, on the matrix unit (a product with a block of ones). A
    ``tl.sum`` adds in an order set by how the block's layout spreads a row over threads,
    which differs between block shapes; the matrix unit adds a row's products in the same
    order in every shape, as it does for the weighted values. Its columns are equal, so their
    maximum is the sum."""
    ones = tl.full([weights.shape[1], 16], 1.0, weights.dtype)
    return tl.max(tl.dot(weights, ones, input_precision=precision), 1)


@triton.jit
def _softmax_step(
    q,
    k,
    v,
    keys,
    pos,
    m_i,
    l_i,
    acc,
    qk_scale,
    MASKED: tl.constexpr,
    FAST_PREFILL: tl.constexpr,
    MATRIX_SUM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    canonical=True,
):
    """Fold one tile of keys (``k`` ``[DIM, TILE]``, ``v`` ``[TILE, DIM]``) into the rows' online
    softmax. ``MASKED``: the causal mask, needed only on tiles some row of the block cannot
    see whole. In a launch compiled with ``MATRIX_SUM``, ``canonical`` (whether the program's
    sequence is; a run-time flag in decode launches) picks the matrix-unit row sum over
    ``tl.sum``. The fast prefill schedule folds the scale into the exponent (one FMA a score);
    every other launch keeps the canonical arithmetic, which a mask that hides nothing leaves
    bit for bit the same."""
    precision: tl.constexpr = "ieee" if DOT_DTYPE == tl.float32 else "tf32"
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=precision)
    if FAST_PREFILL:
        if MASKED:
            s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row with no key yet (a split past it) keeps an empty state: no NaN from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
    else:
        s = _rounded_product(s, qk_scale, INTERPRET)
        if MASKED:
            s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Forced to exactly 1 when the max is unchanged (e.g. a tile past the row's position).
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        # A row with no key yet in this split (a later split of a short row that split 0's
        # program folds) keeps an empty state: no NaN from -inf - -inf.
        p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
    weights = p.to(DOT_DTYPE)
    exact = canonical if MATRIX_SUM else False
    if exact:
        tile_sum = _row_sum(weights, precision)
    else:
        tile_sum = tl.sum(p, 1)
    l_i = l_i * alpha + tile_sum
    acc = tl.dot(weights, v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=precision)
    return m_new, l_i, acc


@triton.jit
def _cache_addresses(table, k_cache_ptr, v_cache_ptr, keys, key_ok, kv_head, dims, kc, vc, BLOCK_SIZE: tl.constexpr):
    """Addresses of K ``[DIM, TILE]`` and V ``[TILE, DIM]`` of ``keys`` in the paged cache
    (``kc``/``vc``: its strides); block-table entries are read where ``key_ok`` (None: all)."""
    if key_ok is None:
        block = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    offset = keys % BLOCK_SIZE
    k_at = k_cache_ptr + block[None, :] * kc[0] + offset[None, :] * kc[1] + kv_head * kc[2] + dims[:, None] * kc[3]
    v_at = v_cache_ptr + block[:, None] * vc[0] + offset[:, None] * vc[1] + kv_head * vc[2] + dims[None, :] * vc[3]
    return k_at, v_at


@triton.jit
def _new_addresses(k_ptr, v_ptr, rows, kv_head, dims, nk, nv):
    """Addresses of K ``[DIM, TILE]`` and V ``[TILE, DIM]`` of flat ``rows`` of the pass's own K/V."""
    rows = rows.to(tl.int64)
    k_at = k_ptr + rows[None, :] * nk[0] + kv_head * nk[1] + dims[:, None] * nk[2]
    v_at = v_ptr + rows[:, None] * nv[0] + kv_head * nv[1] + dims[None, :] * nv[2]
    return k_at, v_at


@triton.jit
def _mixed_tile(
    table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, keys, kv_stop, first_new, new_row0, kv_head, dims, dim_ok,
    kc, vc, nk, nv, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V of a tile that may hold keys of both kinds: those before ``first_new`` from the
    cache, the pass's own from ``k``/``v`` (flat row ``new_row0 + key - first_new``), one load
    each with the address chosen per key; 0 from ``kv_stop`` on."""
    key_ok = keys < kv_stop
    cached = keys < first_new
    k_at, v_at = _cache_addresses(
        table, k_cache_ptr, v_cache_ptr, keys, key_ok & cached, kv_head, dims, kc, vc, BLOCK_SIZE
    )
    if k_ptr is not None:
        k_new, v_new = _new_addresses(k_ptr, v_ptr, new_row0 + keys - first_new, kv_head, dims, nk, nv)
        k_at = tl.where(cached[None, :], k_at, k_new)
        v_at = tl.where(cached[:, None], v_at, v_new)
    k = tl.load(k_at, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    v = tl.load(v_at, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _new_tile(
    k_ptr, v_ptr, k_desc, v_desc, row, kv_head, dims, dim_ok, nk, nv, TILE: tl.constexpr, HEAD_DIM: tl.constexpr
):  # fmt: skip
    """K and V of ``TILE`` consecutive new tokens from flat row ``row`` of ``k``/``v``: tensor
    memory accelerator loads through the descriptors where the launch has them, plain loads
    of the same values otherwise."""
    if k_desc is not None:
        k = k_desc.load([row, kv_head * HEAD_DIM]).T
        v = v_desc.load([row, kv_head * HEAD_DIM])
    else:
        k_at, v_at = _new_addresses(k_ptr, v_ptr, row + tl.arange(0, TILE), kv_head, dims, nk, nv)
        k = tl.load(k_at, mask=dim_ok[:, None], other=0.0)
        v = tl.load(v_at, mask=dim_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _fresh(BLOCK_M: tl.constexpr, DIM: tl.constexpr):
    """An online-softmax state with no keys: (max -inf, sum 0, acc 0), which ``_merge`` folds
    as an exact no-op."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    return m, tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M, DIM], tl.float32)


@triton.jit
def _fold_split(
    m_f, l_f, acc_f, m_i, l_i, acc, tile_end, kv_stop, split_size,
    FOLD: tl.constexpr, BLOCK_M: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """After a tile ending at ``tile_end``: where it is the last of a split but not of the
    program, fold the split's state into the program's and start the next split fresh.
    ``FOLD`` False (a fast program, one split): nothing to do."""
    if FOLD:
        if (tile_end % split_size == 0) & (tile_end < kv_stop):
            m_f, l_f, acc_f = _merge(m_f, l_f, acc_f, m_i, l_i, acc)
            m_i, l_i, acc = _fresh(BLOCK_M, DIM)
    return m_f, l_f, acc_f, m_i, l_i, acc


@triton.jit
def _attend_splits(
    q, pos, valid, table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, k_desc, v_desc, first, start, kv_stop, split_size,
    visible, first_new, new_row0, kv_head, dims, dim_ok, qk_scale, kc, vc, nk, nv, partials, part,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FAST_PREFILL: tl.constexpr, MATRIX_SUM: tl.constexpr, STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Online softmax of a prompt block over its program's keys ``[start, kv_stop)``, whole
    splits of ``split_size`` keys (the last cut at the block's last row), in increasing tile
    order, one software-pipelined loop per kind of tile. Tiles every row of the block sees
    whole (keys below ``visible``) run unmasked: those before ``first_new`` gathered from the
    cache, then a tile holding keys of both kinds, then the pass's own keys read straight from
    ``k``/``v``; the one or two diagonal tiles left load per key and apply the causal mask.
    Each split starts from a fresh state; every split but the last is folded into the pass's
    own at its last tile (``_fold_split``), so the loads run on across split boundaries instead
    of draining at each, and the last is finished after the loops (``_finish_split``: folded
    where the program holds split 0, else left for the combine, which folds in the same
    order). So a pass holding several splits must be split 0's program's. Returns the fold."""
    # The loop over the pass's own keys runs one stage fewer than the launch: the cache
    # loop's loads wait on its block-table loads, so both then hold as many buffers, and the
    # canonical program fits sm_90's 227 KB of shared memory (bf16: 169 KB, 233 KB at the
    # launch's depth; ``tests/sm90_shared_memory.py``). A fast prefill program fills a
    # multiprocessor with its registers alone, so its loop keeps the launch's depth. The
    # diagonal tiles are not pipelined, which keeps their registers down.
    new_stages: tl.constexpr = STAGES if FAST_PREFILL else (STAGES - 1 if STAGES > 1 else 1)
    m_f, l_f, acc_f = _fresh(BLOCK_M, DIM)
    m_i, l_i, acc = _fresh(BLOCK_M, DIM)
    masked_start = tl.maximum(tl.minimum(kv_stop, visible // TILE * TILE), start)
    cache_end = tl.minimum(tl.maximum(first_new // TILE * TILE, start), masked_start)
    for tile_start in range(start, cache_end, TILE):
        keys = tile_start + tl.arange(0, TILE)
        k_at, v_at = _cache_addresses(table, k_cache_ptr, v_cache_ptr, keys, None, kv_head, dims, kc, vc, BLOCK_SIZE)
        k = tl.load(k_at, mask=dim_ok[:, None], other=0.0)
        v = tl.load(v_at, mask=dim_ok[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(
            q, k, v, keys, pos, m_i, l_i, acc, qk_scale, False, FAST_PREFILL, MATRIX_SUM, DOT_DTYPE, INTERPRET
        )
        m_f, l_f, acc_f, m_i, l_i, acc = _fold_split(
            m_f, l_f, acc_f, m_i, l_i, acc, tile_start + TILE, kv_stop, split_size, not FAST_PREFILL, BLOCK_M, DIM
        )
    if k_ptr is not None:
        new_start = tl.minimum(tl.maximum(tl.cdiv(first_new, TILE) * TILE, cache_end), masked_start)
        for tile_start in tl.range(cache_end, new_start, TILE, num_stages=1):
            keys = tile_start + tl.arange(0, TILE)
            k, v = _mixed_tile(
                table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, keys, kv_stop, first_new, new_row0, kv_head, dims,
                dim_ok, kc, vc, nk, nv, BLOCK_SIZE,
            )
            m_i, l_i, acc = _softmax_step(
                q, k, v, keys, pos, m_i, l_i, acc, qk_scale, False, FAST_PREFILL, MATRIX_SUM, DOT_DTYPE, INTERPRET
            )
            m_f, l_f, acc_f, m_i, l_i, acc = _fold_split(
                m_f, l_f, acc_f, m_i, l_i, acc, tile_start + TILE, kv_stop, split_size, not FAST_PREFILL, BLOCK_M, DIM
            )
        for tile_start in tl.range(new_start, masked_start, TILE, num_stages=new_stages):
            keys = tile_start + tl.arange(0, TILE)
            k, v = _new_tile(
                k_ptr, v_ptr, k_desc, v_desc, new_row0 + tile_start - first_new, kv_head, dims, dim_ok, nk, nv,
                TILE, HEAD_DIM,
            )
            m_i, l_i, acc = _softmax_step(
                q, k, v, keys, pos, m_i, l_i, acc, qk_scale, False, FAST_PREFILL, MATRIX_SUM, DOT_DTYPE, INTERPRET
            )
            m_f, l_f, acc_f, m_i, l_i, acc = _fold_split(
                m_f, l_f, acc_f, m_i, l_i, acc, tile_start + TILE, kv_stop, split_size, not FAST_PREFILL, BLOCK_M, DIM
            )
    for tile_start in tl.range(masked_start, kv_stop, TILE, num_stages=1):
        keys = tile_start + tl.arange(0, TILE)
        k, v = _mixed_tile(
            table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, keys, kv_stop, first_new, new_row0, kv_head, dims, dim_ok,
            kc, vc, nk, nv, BLOCK_SIZE,
        )
        m_i, l_i, acc = _softmax_step(
            q, k, v, keys, pos, m_i, l_i, acc, qk_scale, True, FAST_PREFILL, MATRIX_SUM, DOT_DTYPE, INTERPRET
        )
        m_f, l_f, acc_f, m_i, l_i, acc = _fold_split(
            m_f, l_f, acc_f, m_i, l_i, acc, tile_start + TILE, kv_stop, split_size, not FAST_PREFILL, BLOCK_M, DIM
        )
    return _finish_split(
        m_f, l_f, acc_f, m_i, l_i, acc, first, (kv_stop - 1) // split_size, split_size, valid, pos, partials, part,
        dims, dim_ok, DIM,
    )  # fmt: skip


@triton.jit
def _decode_splits(
    q, pos, valid, table, k_cache_ptr, v_cache_ptr, first, end, split_size, kv_head, dims, dim_ok, qk_scale, kc, vc,
    partials, part,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    MATRIX_SUM: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr, canonical,
):  # fmt: skip
    """A decode program's splits from ``first`` on, keys up to ``end`` (the kernel's), in one
    software-pipelined loop over their tiles (masked: a decode row's keys end inside its last
    tile). Each split's state still
    starts fresh and is finished at the split's last tile (``_finish_split``), so a row gets
    the bits of one loop a split; but the loads run ahead across split boundaries instead of
    draining the pipeline at each one, which made short splits dear to a full batch, whose
    programs fold all of a row's splits. Returns the program's fold (split 0's program)."""
    m_f, l_f, acc_f = _fresh(BLOCK_M, DIM)
    m_i, l_i, acc = m_f, l_f, acc_f
    for tile_start in tl.range(first * split_size, end, TILE, num_stages=STAGES):
        keys = tile_start + tl.arange(0, TILE)
        k, v = _mixed_tile(
            table, k_cache_ptr, v_cache_ptr, None, None, keys, end, end, 0, kv_head, dims, dim_ok, kc, vc, kc, vc,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = _softmax_step(
            q, k, v, keys, pos, m_i, l_i, acc, qk_scale, True, False, MATRIX_SUM, DOT_DTYPE, INTERPRET, canonical
        )
        if ((tile_start + TILE) % split_size == 0) | (tile_start + TILE >= end):
            m_f, l_f, acc_f = _finish_split(
                m_f, l_f, acc_f, m_i, l_i, acc, first, tile_start // split_size, split_size, valid, pos, partials,
                part, dims, dim_ok, DIM,
            )  # fmt: skip
            m_i, l_i, acc = _fresh(BLOCK_M, DIM)
    return m_f, l_f, acc_f


@triton.jit
def _finish_split(
    m_f, l_f, acc_f, m_i, l_i, acc, first, split, split_size, valid, pos, partials, part, dims, dim_ok,
    DIM: tl.constexpr,
):  # fmt: skip
    """Split ``split``'s state: folded into the program's running fold where the program holds
    split 0, else written to its partial slot for the combine. Returns the fold."""
    if first == 0:
        m_f, l_f, acc_f = _merge(m_f, l_f, acc_f, m_i, l_i, acc)
    else:
        reach = valid & (pos >= split * split_size)
        _store_partial(partials, part + split, reach, m_i, l_i, acc, dims, dim_ok, DIM)
    return m_f, l_f, acc_f


@triton.jit
def _store_partial(partials, at, rows, m_i, l_i, acc, dims, dim_ok, DIM: tl.constexpr):
    """A split state of ``rows`` into partial slot ``at`` (flat index) of ``partials`` (acc,
    max, sum), for the combine kernel."""
    tl.store(partials[1] + at, m_i, mask=rows)
    tl.store(partials[2] + at, l_i, mask=rows)
    tl.store(partials[0] + at[:, None] * DIM + dims[None, :], acc, mask=rows[:, None] & dim_ok[None, :])


@triton.jit(
    do_not_specialize=[
        "num_seqs", "serve", "fast_programs", "min_keys", "canonical_split", "canonical_row_splits",
        "canonical_programs", "num_slots",
        "stride_bt",
    ]
)
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    tickets_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    canonical_ptr,
    qk_scale,
    num_seqs,
    serve,
    fast_programs,
    min_keys,
    canonical_split,
    canonical_row_splits,
    canonical_programs,
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
    stride_nkt,
    stride_nkh,
    stride_nkd,
    stride_nvt,
    stride_nvh,
    stride_nvd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FAST_PREFILL: tl.constexpr,
    MATRIX_SUM: tl.constexpr,
    BY_SEQUENCE: tl.constexpr,
    PROMPT: tl.constexpr,
    STAGES: tl.constexpr,
    FOLD_LAST: tl.constexpr,
    FOLD_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online-softmax attention of one query block over its ``group`` splits (see the module doc).

    ``k_ptr``/``v_ptr`` (None: every key from the cache) are the pass's own keys and values,
    ``k_desc``/``v_desc`` (None: plain loads) TMA descriptors over them. ``FAST_PREFILL``: a
    fast launch with prompt rows, one split per program, so no fold state beside the split's.
    ``MATRIX_SUM``: the launch serves canonical sequences, whose rows sum their softmax weights
    on the matrix unit (``_row_sum``). ``BY_SEQUENCE`` (a decode launch serving both schedules
    over many sequences, ``_SUM_BY_SEQUENCE_FROM``): each program branches on its sequence's
    flag around that sum alone, so fast rows keep the cheaper ``tl.sum``; two copies of the
    whole tile loop in one kernel made decode 1.3-1.7x slower in both schedules (H200,
    2026-12-01). Otherwise every row of a ``MATRIX_SUM`` launch takes the matrix-unit sum.
    ``FOLD_LAST``: the last program of a query block to finish folds the block's partials
    (``_fold_if_last``, ``tickets_ptr``; ``FOLD_ROWS`` rows, ``PREFETCH`` splits a step);
    otherwise ``_combine_kernel`` does.
    """
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q, not PROMPT, FAST_PREFILL
    )
    if done:
        return
    canonical, served, split_size, group = _sequence_schedule(
        canonical_ptr, seq_lens_ptr, seq, last_pos, serve, fast_programs, min_keys, canonical_split,
        canonical_row_splits, canonical_programs, TILE,
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
    q_start = tl.load(query_start_loc_ptr + seq)
    first_query = tl.load(seq_lens_ptr + seq) - tl.load(query_start_loc_ptr + seq + 1) + q_start
    # Keys below ``visible`` are seen by every row of the block (rows sit at positions from
    # the block's first one or the sequence's first query on), so their tiles need no mask.
    visible = tl.maximum(last_pos // BLOCK_Q * BLOCK_Q, first_query) + 1
    if k_ptr is not None:
        first_new = first_query
    else:
        first_new = last_pos + 1
    kc = (stride_kb, stride_ks, stride_kh, stride_kd)
    vc = (stride_vb, stride_vs, stride_vh, stride_vd)
    nk = (stride_nkt, stride_nkh, stride_nkd)
    nv = (stride_nvt, stride_nvh, stride_nvd)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    partials = (part_acc_ptr, part_max_ptr, part_sum_ptr)
    part = (token * tl.num_programs(1) * GROUP + head) * num_slots
    end = tl.minimum(stop * split_size, last_pos + 1)
    if FAST_PREFILL:
        m_f, l_f, acc_f = _attend_splits(
            q, pos, valid, table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, k_desc, v_desc, first, first * split_size,
            end, split_size, visible, first_new, q_start, kv_head, dims, dim_ok, qk_scale, kc, vc, nk, nv, partials,
            part, BLOCK_SIZE, BLOCK_M, TILE, HEAD_DIM, DIM, DOT_DTYPE, True, False, STAGES, INTERPRET,
        )  # fmt: skip
    elif PROMPT:
        # Split 0's program walks all its splits in one pass, folding as it goes; any other
        # walks one split a pass and leaves each state for the combine after its tile loops (a
        # store inside a pipelined tile loop converts the accumulator's layout through a 64 KB
        # buffer beside the loop's K/V buffers, past sm_90's shared memory). A fast program
        # holds one split, and runs no such loop around its tile loops (ptxas: 148 bytes of
        # spills a thread with it, 16 without).
        m_f, l_f, acc_f = _fresh(BLOCK_M, DIM)
        span = tl.where(first == 0, end, split_size)
        for start in range(first * split_size, end, span):
            m_f, l_f, acc_f = _attend_splits(
                q, pos, valid, table, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, k_desc, v_desc, first, start,
                tl.minimum(start + span, end), split_size, visible, first_new, q_start, kv_head, dims, dim_ok, qk_scale,
                kc, vc, nk, nv, partials, part, BLOCK_SIZE, BLOCK_M, TILE, HEAD_DIM, DIM, DOT_DTYPE, False,
                MATRIX_SUM, STAGES, INTERPRET,
            )  # fmt: skip
    else:
        m_f, l_f, acc_f = _decode_splits(
            q, pos, valid, table, k_cache_ptr, v_cache_ptr, first, end, split_size, kv_head, dims, dim_ok, qk_scale,
            kc, vc, partials, part, BLOCK_SIZE, BLOCK_M, TILE, DIM, DOT_DTYPE, MATRIX_SUM, STAGES, INTERPRET,
            canonical if BY_SEQUENCE else True,
        )  # fmt: skip
    if first == 0:
        complete = pos // split_size < stop
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
            (acc_f / l_f[:, None]).to(out_ptr.dtype.element_ty),
            mask=(valid & complete)[:, None] & dim_ok[None, :],
        )
        # Rows with splits beyond this program leave their fold so far in slot 0.
        _store_partial(partials, part, valid & ~complete, m_f, l_f, acc_f, dims, dim_ok, DIM)
    if FOLD_LAST:
        _fold_if_last(
            tickets_ptr, out_ptr, partials, q_start, last_pos, split_size, group, num_slots, dims, dim_ok, stride_ot,
            stride_oh, stride_od, GROUP, FOLD_ROWS, DIM, PREFETCH,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=[
        "num_seqs", "serve", "fast_programs", "min_keys", "canonical_split", "canonical_row_splits",
        "canonical_programs", "num_slots"
    ]
)
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
    fast_programs,
    min_keys,
    canonical_split,
    canonical_row_splits,
    canonical_programs,
    num_slots,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
    DIMS: tl.constexpr,
    PROMPT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The combine of a launch that does not fold its own partials (``_fold_if_last``): the
    left fold of the rows that split 0's program left unfinished. A program folds
    ``DIMS`` of the head dimensions (the third grid axis): the fold is elementwise, so this
    spreads a lone long row's partials over more multiprocessors without changing a bit."""
    seq, done, token, head, valid, pos, last_pos = _block_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q, not PROMPT
    )
    if done:
        return
    _, served, split_size, group = _sequence_schedule(
        canonical_ptr, seq_lens_ptr, seq, last_pos, serve, fast_programs, min_keys, canonical_split,
        canonical_row_splits, canonical_programs, TILE,
    )
    block_splits = last_pos // split_size + 1
    if (~served) | (block_splits <= group):
        return
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    part = (token * tl.num_programs(1) * GROUP + head) * num_slots
    partials = (part_acc_ptr, part_max_ptr, part_sum_ptr)
    _fold_partials(
        out_ptr, partials, part, valid, pos, split_size, group, block_splits, token, head, dims, dims < HEAD_DIM,
        stride_ot, stride_oh, stride_od, DIM, PREFETCH,
    )  # fmt: skip


@triton.jit
def _fold_partials(
    out_ptr, partials, part, valid, pos, split_size, group, block_splits, token, head, dims, dim_ok, stride_ot,
    stride_oh, stride_od, DIM: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Continue the left fold of the rows that split 0's program left unfinished (those with
    more than ``group`` splits): its fold in slot 0, then every later split's state, in
    increasing split order, and store their outputs. ``dims`` may be a slice of the head's
    dimensions (the fold is elementwise). The loads bypass L1: the states were stored by other
    programs of the same launch where the last of them folds (``_fold_if_last``)."""
    part_acc_ptr, part_max_ptr, part_sum_ptr = partials
    row_splits = pos // split_size + 1
    rows = valid & (row_splits > group)
    m_i = tl.load(part_max_ptr + part, mask=rows, other=0.0, cache_modifier=".cg")
    l_i = tl.load(part_sum_ptr + part, mask=rows, other=1.0, cache_modifier=".cg")
    acc = tl.load(
        part_acc_ptr + part[:, None] * DIM + dims[None, :], mask=rows[:, None] & dim_ok[None, :], other=0.0,
        cache_modifier=".cg",
    )
    # PREFETCH splits a step: every state of the step is loaded before the first is folded, so
    # their loads are in flight at once. The fold is serial, its loads are not (a lone long
    # row has dozens of splits).
    for base in range(group, block_splits, PREFETCH):
        states = ()
        for i in tl.static_range(PREFETCH):
            live = rows & (base + i < row_splits)
            m_s = tl.load(part_max_ptr + part + base + i, mask=live, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_sum_ptr + part + base + i, mask=live, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(
                part_acc_ptr + (part + base + i)[:, None] * DIM + dims[None, :],
                mask=live[:, None] & dim_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            states = states + ((m_s, l_s, acc_s),)
        for i in tl.static_range(PREFETCH):
            m_s, l_s, acc_s = states[i]
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=rows[:, None] & dim_ok[None, :],
    )


@triton.jit
def _fold_if_last(
    tickets_ptr, out_ptr, partials, token, last_pos, split_size, group, num_slots, dims, dim_ok, stride_ot, stride_oh,
    stride_od, GROUP: tl.constexpr, FOLD_ROWS: tl.constexpr, DIM: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """A decode launch's combine, in the launch: each program of a query block (one row
    ``token`` at ``last_pos``) whose splits span several programs takes a ticket once its
    states are stored, and the last to arrive folds them (``_fold_partials``, the combine
    kernel's fold, so the same bits) and puts the block's ticket back to 0 for the next launch.
    A lone long row then waits for no second kernel to start, find its sequence and schedule
    again before its fold begins. The fold takes the block's ``GROUP`` heads alone
    (``FOLD_ROWS``, their power of two), not its 16 padded rows, so its loads of up to
    ``PREFETCH`` splits' states are in flight at once. H200, a lone decode row, a layer in a
    16-call graph, against the combine kernel: 8k keys 15.2-16.3 us against 16.7-18.3 (0.86-0.92x),
    32k 43.8-45.7 against 45.6-49.0 (0.93-0.96x), 512-800 keys 0.96-1.04x; full batches fold
    nothing (2026-12-03)."""
    block_splits = last_pos // split_size + 1
    programs = tl.cdiv(block_splits, group)
    if programs > 1:
        ticket_at = tickets_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()  # every thread's stores before the ticket's release
        if tl.atomic_add(ticket_at, 1, sem="acq_rel") == programs - 1:
            tl.store(ticket_at, 0)
            m = tl.arange(0, FOLD_ROWS)
            head = tl.program_id(1) * GROUP + m
            tokens = token.to(tl.int64) + tl.zeros_like(m).to(tl.int64)
            part = (tokens * tl.num_programs(1) * GROUP + head) * num_slots
            _fold_partials(
                out_ptr, partials, part, m < GROUP, last_pos + tl.zeros_like(m), split_size, group, block_splits,
                tokens, head, dims, dim_ok, stride_ot, stride_oh, stride_od, DIM, PREFETCH,
            )  # fmt: skip


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
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a mixed prompt batch's canonical launch runs on, beside the fast launch."""
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=None)
def _unused_partials(device: torch.device) -> torch.Tensor:
    """Stand-in partial buffer when nothing splits: same dtype, so the same compiled kernel."""
    return torch.empty(1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _tickets(device: torch.device) -> tuple[torch.Tensor, ...]:
    """``_fold_if_last``'s counters, one row a kind of launch (``serve`` - 1: a step's fast and
    canonical launches may run at once, on two streams; views made once, so a launch indexes a
    tuple, not a tensor), one counter a query block and KV head,
    all 0 between launches (the last program puts its block's back). Made once, by a device's
    first launch (an engine's first pass is eager, before any CUDA graph capture), so every
    graph and eager call shares the same zeroed memory."""
    assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "tickets made during a capture"
    return tuple(torch.zeros((_SERVE_BOTH, _TICKETS), dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=None)
def _uniform_flags(device: torch.device, canonical: bool, length: int) -> torch.Tensor:
    """Per-sequence schedule flags of a batch that runs one schedule (lengths are powers of two)."""
    return torch.full((length,), int(canonical), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Tensor memory accelerator: sm_90 and later; the interpreter runs descriptor loads too."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return knobs.runtime.interpret


def _tensor_descriptors(
    k: torch.Tensor, v: torch.Tensor, tile: int, head_dim: int
) -> tuple[TensorDescriptor, TensorDescriptor] | tuple[None, None]:
    """TMA descriptors of one tile of one KV head of the pass's own K/V, seen as ``[tokens,
    kv_heads * head_dim]``; (None, None) where the device or the layout rules them out (a
    head_dim that is not the kernel's padded one, heads or dimensions not contiguous, rows not
    16-byte aligned)."""
    if not _has_tma(k.device) or head_dim != max(16, _next_power_of_2(head_dim)):
        return None, None
    descriptors = []
    for t in (k, v):
        rows, heads, dim = t.shape
        aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
        if not aligned or t.stride(2) != 1 or t.stride(1) != dim:
            return None, None
        descriptors.append(TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], [tile, head_dim]))
    return descriptors[0], descriptors[1]


def _stages(sched: _Schedule, element_size: int) -> int:
    """Software-pipelining depth of a launch. The canonical prompt launch on 4-byte elements
    runs one stage: compiled for sm_90 at head_dim 128 it needs 263 KB of shared memory with
    three stages and 262 KB with two, against the H200's 227 KB, and 197 KB with one. Stages
    only order the loads, so a row keeps its bits."""
    if element_size > 2 and sched.prompt and not sched.fast_prefill:
        return 1
    return sched.num_stages


def _constants(sched: _Schedule) -> tuple[int | bool, ...]:
    """What a launch compiles and runs with, apart from its split and group (which each
    sequence reads for itself): schedules that agree on it can share one launch."""
    return (sched.block_m, sched.kv_tile, sched.num_warps, sched.num_stages, sched.prompt, sched.fast_prefill,
            sched.hopper)


def _fast_split(keys: int, programs: int, tile: int, min_keys: int) -> int:
    """Keys a split holds when a fast sequence of ``keys`` keys spreads over ``programs``:
    whole tiles, at least ``min_keys`` (``_sequence_schedule`` computes the same in the
    kernel, from each sequence's own length)."""
    return max(_cdiv(_cdiv(keys, programs), tile) * tile, min_keys)


def _row_splits(group: int) -> int:
    """The canonical ``row_splits`` of a model whose GQA group is ``group``; 0 (a fixed split
    size) where a prompt block of its rows (``prefill_block_m // group`` positions) could
    straddle a change of size: a group that is not a power of two (Qwen2.5-7B's 7, 3 in the
    trained test model). A function of the model alone, so every batch agrees."""
    cfg = CANONICAL_CONFIG
    block_q = max(cfg["prefill_block_m"], _next_power_of_2(group)) // group
    return cfg["row_splits"] if cfg["kv_split"] * cfg["row_splits"] % block_q == 0 else 0


def _canonical_split(pos: int, row_splits: int) -> int:
    """Keys in each canonical split of the row at ``pos`` (``_sequence_schedule`` computes the
    same in the kernel): ``kv_split``, doubled until the row has at most ``row_splits``."""
    split = CANONICAL_CONFIG["kv_split"]
    for _ in range(_SPLIT_DOUBLINGS.value):
        if row_splits and pos >= row_splits * split:
            split *= 2
    return split


def _canonical_row_splits(keys: int, row_splits: int) -> int:
    """The most canonical splits a row among the first ``keys`` positions has: the last row's,
    or ``row_splits`` for the last row of a shorter split size."""
    pos = keys - 1
    split = _canonical_split(pos, row_splits)
    return max(pos // split + 1, row_splits if split > CANONICAL_CONFIG["kv_split"] else 1)


def _decode_spread(programs: int, device: torch.device) -> int:
    """Splits of a fast decode launch with ``programs`` query blocks x KV heads: the target's
    programs over them rounded down, unless rounding up takes fewer waves a split
    (``_DECODE_PROGRAMS_AT_ONCE``). Rounding up alone left a last wave of a few programs with
    the GPU idle (H200, a layer in a 16-call graph, 8 KV heads: 8 x 32k keys in 9 splits, 576
    programs, 324 us; in 8, 512 programs, 271 us; 16 x 8k 161 -> 144 us; a Qwen3-0.6B decode
    step at 8 x 32k 9.89 -> 8.39 ms; 2026-12-03). Where rounding down would leave one full wave
    and a few programs of whole rows (batch 34-49 with 8 KV heads), the launch keeps rounding up."""
    target, at_once = _target_programs(device), _DECODE_PROGRAMS_AT_ONCE * _num_sms(device)
    low, high = max(1, target // programs), _cdiv(target, programs)
    return high if _cdiv(programs * high, at_once) * low < _cdiv(programs * low, at_once) * high else low


def _min_keys(decode: bool, programs: int, device: torch.device) -> int:
    """The fewest keys a program of a launch with ``programs`` query blocks x KV heads walks."""
    return _FULL_MIN_PROGRAM_KEYS if decode and programs >= _num_sms(device) else _MIN_PROGRAM_KEYS


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: ``triton.cdiv`` is a JIT function, and calling one from
    Python took ~9 us (eight calls were half of this wrapper's host time per layer)."""
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on the host: that one is a constexpr function, whose
    wrapper cost a few microseconds a call."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _target_programs(device: torch.device, prompt: bool = False) -> int:
    """Programs split-KV spreads a launch to. A canonical prompt program fills a multiprocessor
    alone (255 registers x 256 threads, 169 KB of shared memory), so its launch spreads only
    below one program a multiprocessor."""
    return (1 if prompt else _PROGRAMS_PER_SM) * _num_sms(device)


def _hopper_prompt(q: torch.Tensor, k_cache: torch.Tensor, rows: _Rows) -> bool:
    """A fast launch over ``rows`` runs as ``hopper_prefill``'s kernel: the pass's own keys
    given (only prompt launches take them), a device and shapes it supports, and query blocks x
    KV heads enough to fill the multiprocessors, since it spreads no split over programs (a
    launch with fewer keeps the Triton one, which does). ``HOPPER_PREFILL`` off: never."""
    if not (HOPPER_PREFILL and rows.own_keys and hopper_prefill.supports(q, k_cache)):
        return False
    block_q = hopper_prefill.BLOCK_M // (q.shape[1] // k_cache.shape[2])
    blocks = _query_blocks(rows.num_tokens, rows.seq_lens.shape[0], rows.max_query_len, block_q)
    return blocks * k_cache.shape[2] >= _num_sms(q.device)


def hopper_canonical(group: int) -> hopper_prefill.Canonical:
    """The canonical tiling ``hopper_prefill`` takes for a model of GQA ``group``: this kernel's
    tiles, splits and split growth. Its rows get this kernel's bits (``tests/test_hopper_prefill.py``)."""
    cfg = CANONICAL_CONFIG
    return hopper_prefill.Canonical(cfg["kv_tile"], cfg["kv_split"], _row_splits(group))


def _query_blocks(num_tokens: int, num_seqs: int, max_query_len: int, block_q: int) -> int:
    """Query blocks holding rows: what the grid's first axis offers before any split."""
    return min(num_seqs * _cdiv(max_query_len, block_q), num_tokens // block_q + num_seqs)


def _canonical_schedule(
    group: int, num_tokens: int, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
    device: torch.device
) -> _Schedule:
    """The fixed canonical constants (a function of the model's GQA group only), and how many
    of a row's splits one program folds: all of them once the batch alone fills the GPU."""
    cfg = CANONICAL_CONFIG
    prompt = max_query_len > 1
    block_m = max(cfg["prefill_block_m"] if prompt else cfg["block_m"], _next_power_of_2(group))
    programs = _query_blocks(num_tokens, num_seqs, max_query_len, block_m // group) * num_kv_heads
    row_splits = _row_splits(group)
    splits = _canonical_row_splits(max_seq_len, row_splits)
    # At least the target's programs: rounding the group up left a lone row of a graph sized
    # for 40,960 keys half of them (80 splits over 66 programs: 2 a program, 40 programs). A
    # decode launch spreads as the fast one does (``_decode_spread``): below one program a row,
    # batch 40 with 8 KV heads walked each row in one program, two waves of which the second
    # held 56 programs (H200, Llama-3.1-8B heads, 40 x 8k: 490 us against the fast 381).
    spread = _decode_spread(programs, device) if not prompt else max(1, _target_programs(device, prompt) // programs)
    min_keys = _min_keys(not prompt, programs, device)
    return _Schedule(
        block_m=block_m,
        kv_tile=cfg["kv_tile"],
        split_size=cfg["kv_split"],
        num_warps=cfg["prefill_num_warps"] if prompt else cfg["num_warps"],
        num_stages=cfg["num_stages"],
        group=max(1, splits // spread, _cdiv(min_keys, cfg["kv_split"])),
        prompt=prompt,
        min_keys=min_keys,
        max_splits=splits,
        row_splits=row_splits,
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
    cfg = FAST_PREFILL_CONFIG
    decode = max_query_len == 1
    if decode:
        block_m, kv_tile, num_warps = max(16, _next_power_of_2(group)), FAST_DECODE_TILE, 4
    else:
        block_m = max(cfg["block_m"], _next_power_of_2(group))
        kv_tile, num_warps = cfg["kv_tile"], cfg["num_warps"]
    programs = _query_blocks(num_tokens, num_seqs, max_query_len, block_m // group) * num_kv_heads
    min_keys = _min_keys(decode, programs, device)
    spread = _decode_spread(programs, device) if decode else _cdiv(_target_programs(device), programs)
    splits = max(1, min(spread, max_seq_len // min_keys, _FAST_MAX_SPLITS))
    split_size = _fast_split(max_seq_len, splits, kv_tile, min_keys)
    max_splits = _cdiv(max_seq_len, split_size)
    if decode:
        return _Schedule(
            block_m, kv_tile, split_size, num_warps, num_stages=3, min_keys=min_keys, max_splits=max_splits
        )
    return _Schedule(
        block_m, kv_tile, split_size, num_warps, cfg["num_stages"], prompt=True, fast_prefill=True, min_keys=min_keys,
        max_splits=max_splits,
    )


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
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    num_decodes: int = 0,
    part_schedules: tuple[tuple[bool, bool], tuple[bool, bool]] | None = None,
) -> torch.Tensor:
    """Causal varlen paged attention of ``q`` ``[N, heads, head_dim]`` over the cache.

    Semantics of ``paged_attention_ref`` (fast) / ``paged_attention_canonical_ref``
    (canonical, bit-stable per row), chosen per sequence: ``canonical`` is one flag for the
    batch, or an int32 ``[S]`` tensor of per-sequence flags. With per-sequence flags,
    ``schedules`` = (any fast sequence, any canonical one) saves a launch; None means both may
    be present. ``max_query_len`` / ``max_seq_len`` are host copies of the batch maxima; pass
    them to keep the launch free of device syncs. Returns ``out`` (allocated if None).

    ``k``/``v`` ``[N, kv_heads, head_dim]`` (any strides, the cache's dtype) are this pass's
    own keys and values, already stored in the cache: given, a sequence's keys from its first
    query row on are read from them, contiguous, instead of gathered through the block table
    (the same values, so the same result). Decode-only steps ignore them: one key a row.

    ``num_decodes``: the batch's first sequences that have one query row each (the host knows;
    0: none known). Beside longer queries, and from ``_DECODE_LAUNCH_FROM`` on, they get a
    decode-shaped launch of their own, and the prompt launch covers the sequences after them:
    in a 128-row prompt block a decode row took a whole block's work (H200, Qwen3-0.6B heads,
    200 decodes of 700 keys beside 8 prompts of 500 rows: 474 us a layer fast and 586
    canonical in one launch, 278 / 288 in two). A canonical row's bits are the same in both
    block shapes (``CANONICAL_CONFIG``). ``part_schedules`` are ``schedules`` for those first
    sequences and for the rest, so each launch runs only the schedules its own sequences take:
    a step whose deterministic rows all decode then makes no canonical prompt launch, and its
    fast decodes keep ``tl.sum`` where its canonical rows are all prompts.

    One layer's call: a step's layers share one ``plan_attention`` and each runs it
    (``run_attention``), as the Triton backend does."""
    plan = plan_attention(
        q, k_cache, block_tables, seq_lens, query_start_loc, canonical=canonical, max_query_len=max_query_len,
        max_seq_len=max_seq_len, schedules=schedules, own_keys=k is not None and v is not None,
        num_decodes=num_decodes, part_schedules=part_schedules,
    )  # fmt: skip
    return run_attention(plan, q, k_cache, v_cache, scale, out=out, k=k, v=v)


class _Kernel(NamedTuple):
    """One kernel launch as a plan prepares it: everything but the layer's own tensors."""

    grid: tuple[int, int, int]
    args: tuple[object, ...]
    """The arguments from the partials on (the attention kernel: up to the scale, which each
    layer passes, and ``after_scale`` the rest; the combine kernel: up to the output's strides)."""
    constants: dict[str, object]
    """Compile-time constants and launch options."""
    after_scale: tuple[object, ...] = ()


class _Launch(NamedTuple):
    """One kernel launch of a plan, and the combine of its partials."""

    rows: _Rows
    sched: _Schedule
    serve: int
    """Which sequences' schedule it runs (``_SERVE_*``)."""
    beside: bool
    """On CUDA, run on the side stream beside the next launch (module doc)."""
    attention: _Kernel
    """The Triton launch (a ``hopper`` schedule's where the layer's own keys rule TMA out)."""
    combine: _Kernel | None
    relaunch: Relaunch
    """The kernels the step's first layer launched, for the other layers to launch directly."""


class _Streams(NamedTuple):
    """A step's stream, the side stream, and the events a layer forks to it and joins back on
    (made once a step: each layer records them again)."""

    main: torch.cuda.Stream
    side: torch.cuda.Stream
    forked: torch.cuda.Event
    joined: torch.cuda.Event


class AttentionPlan(NamedTuple):
    """A step's attention launches, found from its metadata alone (``plan_attention``). Every
    layer of the step runs the same ones (``run_attention``), so the host plans once a step:
    a layer's host time went from 47 to 14 us in a fast prompt step and from 74 to 20 in a
    mixed one (a CPU, 100 decodes beside 8 prompts, the launches themselves stubbed out;
    2026-12-04). The plan prepares each launch's arguments but the layer's own tensors
    (``_prepare``), and the layers after the first launch the kernels it launched directly
    (``Relaunch``), without Triton's JIT call. Its launches share one buffer of split states
    for the combine, indexed by the step's rows: the layers reuse it one after another on the
    stream."""

    launches: tuple[_Launch, ...]
    slots: int
    """Split states a row and head has room for in the shared buffer."""
    own_keys: bool
    """Prompt launches read the pass's own keys from ``k``/``v`` (``run_attention``)."""
    streams: _Streams | None
    """Where launches run beside each other, the streams and events they fork and join on."""


def plan_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    canonical: bool | torch.Tensor,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    schedules: tuple[bool, bool] | None = None,
    own_keys: bool = False,
    num_decodes: int = 0,
    part_schedules: tuple[tuple[bool, bool], tuple[bool, bool]] | None = None,
) -> AttentionPlan:
    """The launches of ``paged_attention`` for a step whose queries have ``q``'s shape and
    dtype (any layer's), with the arguments of the same names; ``own_keys``: the layers will
    pass their ``k``/``v``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return AttentionPlan((), 1, False, None)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    own_keys = own_keys and max_query_len > 1
    if isinstance(canonical, torch.Tensor):
        flags, (any_fast, any_canonical) = canonical, schedules or (True, True)
    else:
        flags = _uniform_flags(q.device, canonical, _next_power_of_2(num_seqs))
        any_fast, any_canonical = not canonical, canonical
    # A launch for each kind of sequence: one-row ones (a step's first ``num_decodes``) beside
    # prompt rows get their own (docstring).
    kinds = [_Rows(num_tokens, max_query_len, block_tables, seq_lens, query_start_loc, flags, own_keys)]
    parts = [(any_fast, any_canonical)]
    if max_query_len > 1 and _DECODE_LAUNCH_FROM <= num_decodes < num_seqs:
        d = num_decodes
        rest = (block_tables[d:], seq_lens[d:], query_start_loc[d:], flags[d:])
        kinds = [
            _Rows(d, 1, block_tables[:d], seq_lens[:d], query_start_loc[: d + 1], flags[:d], False),
            _Rows(num_tokens - d, max_query_len, *rest, own_keys),
        ]
        if isinstance(canonical, torch.Tensor) and part_schedules is not None:
            parts = list(part_schedules)
        else:
            parts *= 2
    found = []
    for rows, (has_fast, has_canonical) in zip(kinds, parts):
        seqs = rows.seq_lens.shape[0]
        shape = (num_kv_heads, rows.max_query_len, max_seq_len, q.device)
        fast = _fast_schedule(rows.num_tokens, seqs, group, *shape) if has_fast else None
        canon = _canonical_schedule(group, rows.num_tokens, seqs, *shape) if has_canonical else None
        if _hopper_prompt(q, k_cache, rows):
            # One program walks a block's every split: the fast schedule has one, the canonical
            # one folds them all in its fixed order.
            fast = fast._replace(hopper=True, max_splits=1, group=1) if fast is not None else None
            canon = canon._replace(hopper=True, group=canon.max_splits) if canon is not None else None
        found.append((rows, fast, canon))
    # Per schedule: a row's splits at most, and its programs along the keys (more than one
    # leave partials for the combine).
    programs = {s: _cdiv(s.max_splits, s.group) for _, fast, canon in found for s in (fast, canon) if s is not None}
    slots = max([s.max_splits for s, p in programs.items() if p > 1] or [1])
    if slots > 1:
        part_acc = torch.empty((num_tokens, num_heads, slots, max(16, _next_power_of_2(head_dim))),
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_heads, slots), dtype=torch.float32, device=q.device)
        partials = (part_acc, part_max, torch.empty_like(part_max))
    else:
        partials = (_unused_partials(q.device),) * 3
    launches = []
    for rows, fast, canon in found:
        splits = (
            programs[fast] if fast is not None else 1,
            canon.row_splits if canon is not None else 0,
            programs[canon] if canon is not None else 1,
        )

        def launch(sched: _Schedule, serve: int, n: int, beside: bool = False) -> _Launch:
            # A decode launch's sequences have one row each: a block a sequence (``_block_rows``).
            blocks = rows.num_tokens // (sched.block_m // group) + 2 * rows.seq_lens.shape[0]
            grid = (rows.seq_lens.shape[0] if not sched.prompt else blocks, num_kv_heads)
            # A decode launch's programs fold their own partials (``_fold_if_last``); a prompt
            # launch's combine spreads a block's 128 rows over more programs (``_prepare``).
            fold_last = n > 1 and not sched.prompt and grid[0] * grid[1] <= _TICKETS
            attention, combine = _prepare(q, k_cache, rows, sched, serve, n, splits, grid, fold_last, partials, slots)
            return _Launch(rows, sched, serve, beside, attention, combine, Relaunch())

        if fast is not None and canon is not None and _constants(fast) == _constants(canon):
            # One launch serves both (module doc): as many programs along the keys as either needs.
            launches.append(launch(canon, _SERVE_BOTH, max(programs[fast], programs[canon])))
        else:
            # The canonical launch first, beside the fast one on CUDA (module doc).
            beside = fast is not None and q.device.type == "cuda"
            if canon is not None:
                launches.append(launch(canon, _SERVE_CANONICAL, programs[canon], beside))
            if fast is not None:
                launches.append(launch(fast, _SERVE_FAST, programs[fast]))
    streams = None
    if any(one.beside for one in launches):
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        streams = _Streams(main, side, torch.cuda.Event(), torch.cuda.Event())
    return AttentionPlan(tuple(launches), slots, own_keys, streams)


def run_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's ``paged_attention`` by ``plan`` (made for this step's metadata and ``q``'s
    shape, on the stream the layers run on): ``q``, the layer's cache, and with
    ``plan.own_keys`` the layer's ``k``/``v``."""
    if out is None:
        out = torch.empty_like(q)
    if plan.own_keys:
        assert k is not None and v is not None, "the plan reads the pass's own keys"
        assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, "k/v must have the cache's dtype"
    else:
        k = v = None
    batch = _Batch(q, k_cache, v_cache, out, scale, k, v)
    joining = False
    for launch in plan.launches:
        if launch.beside:
            # The join after the next launch orders every later use of ``out`` and of the
            # partials after both.
            assert plan.streams is not None
            main, side, forked, joined = plan.streams
            forked.record(main)
            side.wait_event(forked)
            with torch.cuda.stream(side):
                _launch(batch, launch)
            joining = True
            continue
        _launch(batch, launch)
        if joining:
            joined.record(side)
            main.wait_event(joined)
            joining = False
    return out


class _Batch(NamedTuple):
    """What every launch of one layer shares: the layer's own tensors."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    scale: float
    k: torch.Tensor | None
    v: torch.Tensor | None

    @property
    def scale_log2(self) -> float:
        """The softmax scale times log2(e): the Triton kernel takes exponents base 2."""
        return self.scale * hopper_prefill.LOG2E


class _Rows(NamedTuple):
    """The sequences one launch covers: views of the step's metadata from some sequence on
    (``query_start_loc`` then starts past row 0; rows keep the step's indices)."""

    num_tokens: int
    max_query_len: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    flags: torch.Tensor
    own_keys: bool
    """Keys from a sequence's first query row on come from the layer's ``k``/``v``."""


def _prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    rows: _Rows,
    sched: _Schedule,
    serve: int,
    programs: int,
    splits: tuple[int, int, int],
    grid: tuple[int, int],
    fold_last: bool,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: int,
) -> tuple[_Kernel, _Kernel | None]:
    """The attention launch over the sequences of ``rows`` with the schedules in ``serve``,
    ``programs`` per query block and KV head along the keys, and the combine of its partials
    (None when there are none to fold, or with ``fold_last`` the programs fold their own,
    ``_fold_if_last``), as every layer of the step makes them: a launch serving both schedules
    has one batch, so one ``min_keys``."""
    fast_programs, canonical_row_splits, canonical_programs = splits
    _, _, block_tables, seq_lens, query_start_loc, flags, _ = rows
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    block_size, head_dim = k_cache.shape[1], q.shape[2]
    group = q.shape[1] // num_kv_heads
    canonical_split = CANONICAL_CONFIG["kv_split"]
    block_q = sched.block_m // group
    dim = max(16, _next_power_of_2(head_dim))
    stages = _stages(sched, k_cache.element_size())
    metadata = (seq_lens, query_start_loc, flags)
    # What ``_sequence_schedule`` reads to give each sequence its schedule, and the partials' slots.
    schedule_args = (num_seqs, serve, fast_programs, sched.min_keys, canonical_split, canonical_row_splits,
                     canonical_programs, slots)  # fmt: skip
    shape = dict(GROUP=group, BLOCK_M=sched.block_m, BLOCK_Q=block_q, TILE=sched.kv_tile, HEAD_DIM=head_dim, DIM=dim)
    attention = _Kernel(
        (*grid, programs),
        (*partials, _tickets(q.device)[serve - 1], block_tables, *metadata),
        dict(
            BLOCK_SIZE=block_size,
            **shape,
            DOT_DTYPE=_dot_dtype(q),
            FAST_PREFILL=sched.fast_prefill,
            MATRIX_SUM=serve != _SERVE_FAST,
            BY_SEQUENCE=serve == _SERVE_BOTH and not sched.prompt and num_seqs >= _SUM_BY_SEQUENCE_FROM,
            PROMPT=sched.prompt,
            STAGES=stages,
            FOLD_LAST=fold_last,
            FOLD_ROWS=_next_power_of_2(group),
            PREFETCH=_FOLD_PREFETCH,
            INTERPRET=knobs.runtime.interpret,
            num_warps=sched.num_warps,
            num_stages=stages,
        ),
        schedule_args,
    )
    if programs == 1 or fold_last:
        return attention, None
    # A 128-row prompt block's program folds a slice of the head's dimensions: all 128 in
    # float32 on four warps spilled (ptxas, sm_90a: 824 bytes a thread).
    dims = min(dim, _COMBINE_DIMS) if sched.prompt else dim
    combine = _Kernel(
        (*grid, _cdiv(dim, dims)),
        (*partials, *metadata, *schedule_args),
        dict(
            **shape,
            DIMS=dims,
            PROMPT=sched.prompt,
            PREFETCH=max(1, min(_COMBINE_PREFETCH, _COMBINE_PREFETCH_ELEMENTS // (sched.block_m * dims))),
            num_warps=_COMBINE_NUM_WARPS,
        ),
    )
    return attention, combine


def _launch(batch: _Batch, launch: _Launch) -> None:
    """One layer's run of a plan's launch (``_prepare``): its tensors added to what the plan
    prepared."""
    q, k_cache, v_cache, out = batch[:4]
    k, v = (batch.k, batch.v) if launch.rows.own_keys else (None, None)
    if launch.sched.hopper and hopper_prefill.tma_ready(k) and hopper_prefill.tma_ready(v):
        rows = launch.rows
        canonical = hopper_canonical(q.shape[1] // k_cache.shape[2]) if launch.serve == _SERVE_CANONICAL else None
        hopper_prefill.prefill_attention(
            q, k, v, k_cache, v_cache, rows.block_tables, rows.seq_lens, rows.query_start_loc, rows.flags,
            batch.scale, out, launch.relaunch, canonical,
        )  # fmt: skip
        return
    # Both schedules read the pass's own keys through descriptors (the canonical prompt launch:
    # 1 x 8,192 1,203 us against 1,265 with plain loads, 8 x 2,048 827 against 845, the same
    # bits; H200, Qwen3-0.6B heads, 2026-12-02).
    k_desc, v_desc = _tensor_descriptors(k, v, launch.sched.kv_tile, q.shape[2]) if k is not None else (None, None)
    new_strides = (*k.stride(), *v.stride()) if k is not None else (0,) * 6
    attention, combine = launch.attention, launch.combine
    table_stride = launch.rows.block_tables.stride(0)
    layer = (q, k_cache, v_cache, k, v, k_desc, v_desc, out)
    strides = (*q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *new_strides, table_stride)
    args = (*layer, *attention.args, batch.scale_log2, *attention.after_scale, *strides)
    launch.relaunch(_attention_kernel, attention.grid, args, attention.constants)
    if combine is not None:
        launch.relaunch(_combine_kernel, combine.grid, (out, *combine.args, *out.stride()), combine.constants)
