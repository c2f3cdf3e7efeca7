"""Triton KV store and paged attention against the torch references (``sid.kernels.attention_ref``).

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET before any kernel module is imported), so sizes are small; on a GPU the same
tests run compiled. Caches are poisoned with NaN wherever nothing was written, block tables
carry holes, shuffled block ids and junk past each sequence's blocks, and outputs start as NaN,
so a kernel that reads or writes outside its contract fails. A step's own keys and values,
which the Triton kernel may read instead of the cache, sit between NaN columns of one fused
projection, as the model hands them over.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from triton._C.libtriton import ir
from triton._C.libtriton.gluon_ir import GluonOpBuilder
from triton.compiler.compiler import CompiledKernel
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from sid.kernels import attention_ref, hopper_prefill
from sid.kernels import paged_attention as attention
from sid.kernels.attention_ref import (
    paged_attention_canonical_ref,
    paged_attention_ref,
    store_kv_ref,
)
from sid.kernels.kv_store import store_kv
from sid.kernels.launch import Relaunch
from sid.runtime import triton_backend
from sid.runtime.attention import AttentionMetadata, TorchAttentionBackend
from sid.runtime.triton_backend import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")
"""Where the CPU backend's own tests run: its canonical schedule rests on the CPU's batched matmuls."""
BLOCK_SIZE = 16
JUNK_BLOCK = 1 << 30
"""Block-table entry past a sequence's blocks: any read of it faults or fails the test."""
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
SM90_SHARED_BYTES = 232_448
"""Shared memory one program may ask for on sm_90: 227 KiB, the H200's limit."""
SPLIT = 1024
"""Canonical split boundary in these tests: the batches below put rows and chunks on both
sides of it. The default split is larger; the split size is a runtime argument of the same
compiled kernel, and a smaller one keeps the interpreter's contexts short."""


@pytest.fixture(autouse=True)
def canonical_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(attention.CANONICAL_CONFIG, "kv_split", SPLIT)


Seq = tuple[list[int], int, torch.Tensor]
"""A step's sequence: block ids, context length, query rows."""


class Pool:
    """A NaN-poisoned paged KV pool; contexts get shuffled, non-contiguous blocks, with holes."""

    def __init__(
        self, num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
        device: torch.device = DEVICE
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.contexts: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        """Block ids of each stored context -> its keys and values."""

    def random_kv(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (length, *self.k.shape[2:])
        return torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Store a context's K/V; returns its block ids. Some free blocks are skipped, leaving holes."""
        blocks = []
        while len(blocks) * BLOCK_SIZE < len(keys):
            if len(self.free) % 3 == 0:
                self.free.pop()
            blocks.append(self.free.pop())
        pos = torch.arange(len(keys))
        slots = torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        store_kv_ref(keys.to(self.device), values.to(self.device), self.k, self.v, slots.to(self.device))
        self.contexts[tuple(blocks)] = keys, values
        return blocks

    def new_kv(self, seqs: list[Seq], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's own K/V (each sequence's last ``len(q)`` keys, in the cache's dtype) as views
        of one NaN-filled fused projection: rows 16-byte aligned (``fused``: TMA descriptors where
        the kernel takes them) or not (``strided``: plain loads)."""
        keys, values = (
            torch.cat([self.contexts[tuple(blocks)][i][ctx - len(q) : ctx] for blocks, ctx, q in seqs])
            for i in (0, 1)
        )
        rows, kv_heads, head_dim = keys.shape
        width = kv_heads * head_dim
        # fused: k | v | 8 NaN columns; strided: NaN | k | NaN | v | NaN, an odd row length.
        pad, gap = (8, 0) if layout == "fused" else (3, 1)
        fused = torch.full((rows, 2 * width + pad), float("nan"), dtype=self.k.dtype, device=self.device)
        k, v = fused[:, gap : gap + width], fused[:, 2 * gap + width : 2 * gap + 2 * width]
        k, v = k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)
        k.copy_(keys)
        v.copy_(values)
        return k, v


@dataclass
class Batch:
    q: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seqs: list[tuple[list[int], int, torch.Tensor]]

    def args(self, pool: Pool) -> tuple:
        return self.q, pool.k, pool.v, self.block_tables, self.seq_lens, self.query_start_loc

    def new_kv(self, pool: Pool, layout: str | None) -> dict[str, torch.Tensor]:
        """``paged_attention``'s ``k``/``v`` for the step (none for ``layout`` None)."""
        return dict(zip("kv", pool.new_kv(self.seqs, layout))) if layout else {}


def make_batch(seqs: list[tuple[list[int], int, torch.Tensor]], device: torch.device = DEVICE) -> Batch:
    """``seqs``: (block ids, context length, query rows). Unused table entries: -1 or junk."""
    width = max(len(blocks) for blocks, _, _ in seqs) + 2
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for s, (blocks, _, _) in enumerate(seqs):
        table[s, : len(blocks)] = torch.tensor(blocks)
        if s % 2:
            table[s, len(blocks) :] = JUNK_BLOCK
    q_lens = torch.tensor([len(q) for _, _, q in seqs])
    return Batch(
        q=torch.cat([q for _, _, q in seqs]).to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor([ctx for _, ctx, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(device),
        seqs=seqs,
    )


def mixed_batch(pool: Pool, heads: int, shapes: list[tuple[int, int]]) -> Batch:
    """Random contexts of (length, query rows): prefill chunks over a cached prefix and decodes."""
    seqs = []
    for ctx, q_len in shapes:
        blocks = pool.add(*pool.random_kv(ctx))
        seqs.append((blocks, ctx, torch.randn(q_len, heads, pool.k.shape[3], generator=pool.gen)))
    return make_batch(seqs, pool.device)


def mixed_shapes(canonical: bool) -> list[tuple[int, int]]:
    """(context, query rows) of a mixed step: a long decode, a fresh prefill, an empty sequence,
    a chunk over a cached prefix, a tiny decode, a short chunk. For the canonical schedule the
    long ones cross its split boundary; the fast one is kept short (the interpreter is slow)."""
    long = SPLIT if canonical else 256
    return [(long + 60, 1), (37, 37), (50, 0), (long + 4, 12), (1, 1), (130, 5)]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("in_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_store_kv_writes_only_its_slots(in_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, kv_heads, head_dim = 40, 2, 64
    # K and V as strided views of one fused projection, like the model's qkv output.
    kv = torch.randn(num_tokens, 2 * kv_heads + 1, head_dim, generator=gen).to(in_dtype).to(DEVICE)
    key, value = kv[:, :kv_heads], kv[:, kv_heads + 1 :]
    slots = torch.randperm(24 * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[::7] = -1
    k_cache = torch.full((24, BLOCK_SIZE, kv_heads, head_dim), -7.0, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, -9.0)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_want, v_want, slots.to(DEVICE))
    store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    assert (k_cache != -7.0).sum() == (slots >= 0).sum() * kv_heads * head_dim


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [
        (torch.float32, 2, 2, 64),
        (torch.float32, 4, 2, 128),
        (torch.float32, 8, 1, 32),
        (torch.bfloat16, 8, 2, 64),
        (torch.float16, 4, 1, 128),
    ],
)
@pytest.mark.parametrize("canonical", [False, True])
@pytest.mark.parametrize("new_kv", [None, "fused", "strided"])
def test_paged_attention_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, canonical: bool, new_kv: str | None
) -> None:
    """Both schedules against their references, prompt chunks reading their keys from the
    cache or from the step's own K/V (``new_kv``: aligned views, or unaligned ones)."""
    pool = Pool(260, kv_heads, head_dim, dtype, seed=heads * 31 + head_dim)
    shapes = mixed_shapes(canonical)
    batch = mixed_batch(pool, heads, shapes)
    batch.q = batch.q.to(dtype)
    scale = 1 / math.sqrt(head_dim)
    # ``out`` is a view inside a NaN buffer: every row must be written, the guard rows never.
    buffer = torch.full((len(batch.q) + 2, *batch.q.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[1:-1]
    got = attention.paged_attention(
        *batch.args(pool),
        scale,
        canonical=canonical,
        out=out,
        max_query_len=37,
        max_seq_len=shapes[0][0],
        **batch.new_kv(pool, new_kv),
    )
    assert got is out
    assert not out.isnan().any()
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()
    ref = paged_attention_canonical_ref if canonical else paged_attention_ref
    _close(out, ref(*batch.args(pool), scale), dtype)


def test_fast_schedule_splits_kv_and_agrees_with_canonical() -> None:
    """A thin decode batch takes the split-KV path; it and the canonical schedule agree."""
    pool = Pool(120, 1, 64, torch.float32, seed=5)
    batch = mixed_batch(pool, 4, [(900, 1), (300, 1)])
    sched = attention._fast_schedule(2, 2, 4, 1, 1, 900, DEVICE)
    assert sched.split_size < 900
    fast = attention.paged_attention(*batch.args(pool), 0.125, canonical=False)
    _close(fast, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)
    canon = attention.paged_attention(*batch.args(pool), 0.125, canonical=True)
    _close(fast, canon, torch.float32)


def test_fast_sequences_spread_their_own_keys_in_a_launch_sized_for_longer_ones() -> None:
    """A decode launch sized for far more keys than its sequences hold, as a CUDA graph is
    (for the model's longest): each sequence spreads its own keys over the launch's programs
    instead of one split of the launch's size, and every row matches the reference."""
    pool = Pool(300, 2, 64, torch.float32, seed=11)
    batch = mixed_batch(pool, 4, [(700, 1), (90, 1), (1500, 1)])
    limit = 8192
    sched = attention._fast_schedule(3, 3, 2, 2, 1, limit, DEVICE)
    programs = attention._cdiv(limit, sched.split_size)
    spread = attention._fast_split(700, programs, sched.kv_tile, sched.min_keys)
    assert programs > 2 and spread * 2 < 700 < sched.split_size
    got = attention.paged_attention(*batch.args(pool), 0.125, canonical=False, max_query_len=1, max_seq_len=limit)
    _close(got, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


def test_a_full_decode_batch_splits_only_long_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a decode batch gives every multiprocessor a program, a fast split holds at least
    ``_FULL_MIN_PROGRAM_KEYS`` keys: a short sequence stays whole, a long one still spreads
    over the launch's programs, and every row matches the reference. The machine has the
    interpreter's nominal multiprocessors here, so 10 programs fill it on a GPU too."""
    monkeypatch.setattr(attention, "_num_sms", lambda device: attention._NOMINAL_SMS)
    shapes = [(700, 1)] * 4 + [(3000, 1)]
    pool = Pool(600, 2, 64, torch.float32, seed=13)
    batch = mixed_batch(pool, 4, shapes)
    limit = 8192
    sched = attention._fast_schedule(5, 5, 2, 2, 1, limit, DEVICE)
    assert 5 * 2 >= attention._num_sms(DEVICE) and sched.min_keys == attention._FULL_MIN_PROGRAM_KEYS
    programs = attention._cdiv(limit, sched.split_size)
    assert attention._fast_split(700, programs, sched.kv_tile, sched.min_keys) >= 700
    assert attention._fast_split(3000, programs, sched.kv_tile, sched.min_keys) < 3000
    got = attention.paged_attention(*batch.args(pool), 0.125, canonical=False, max_query_len=1, max_seq_len=limit)
    _close(got, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


def test_decode_splits_take_the_fewest_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode launch's fast splits (on an H200's 132 multiprocessors, 8 KV heads): the
    target's programs rounded down, unless rounding up takes fewer waves a split. Rounding up
    alone gave batch 8 nine splits, 576 programs, a third wave of 48 (2026-12-03); batch 40
    keeps two splits, since one would leave a wave of 56 whole rows after the first. The
    canonical launch spreads a row over as many programs (it walked batch 40's rows whole)."""
    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    target = attention._target_programs(DEVICE)
    at_once = attention._DECODE_PROGRAMS_AT_ONCE * 132

    def splits(batch: int) -> int:
        return attention._cdiv(40960, attention._fast_schedule(batch, batch, 4, 8, 1, 40960, DEVICE).split_size)

    def canonical_programs(batch: int) -> int:
        sched = attention._canonical_schedule(4, batch, batch, 8, 1, 40960, DEVICE)
        return attention._cdiv(sched.max_splits, sched.group)

    assert (splits(8), splits(16), splits(40), splits(64)) == (8, 4, 2, 1)
    assert [canonical_programs(b) for b in (8, 16, 40, 64)] == [8, 4, 2, 1]
    for batch in range(4, 80):  # batch 1-3: ``_FAST_MAX_SPLITS`` caps the splits first
        programs, chosen = batch * 8, splits(batch)
        fewer = max(1, target // programs)
        assert chosen in (fewer, attention._cdiv(target, programs)), batch
        waves = attention._cdiv(programs * chosen, at_once) / chosen
        assert waves <= attention._cdiv(programs * fewer, at_once) / fewer, batch


@pytest.mark.parametrize("new_kv", [None, "fused", "strided"])
def test_fast_prompt_rows_split_kv(new_kv: str | None) -> None:
    """A thin prompt step splits the fast schedule's keys too, at a boundary inside a 128-row
    query block, so some of its rows have no key in a split; with the chunk's keys read from
    the cache or from the step's own K/V the rows match the reference."""
    ctx, q_len = 1100, 200
    pool = Pool(120, 2, 64, torch.float32, seed=7)
    batch = mixed_batch(pool, 2, [(ctx, q_len)])
    sched = attention._fast_schedule(q_len, 1, 1, 2, q_len, ctx, DEVICE)
    # The kernel's split for this sequence.
    split = attention._fast_split(ctx, attention._cdiv(ctx, sched.split_size), sched.kv_tile, sched.min_keys)
    boundaries = range(split, ctx, split)
    assert sched.fast_prefill and any(b % 128 for b in boundaries if b > ctx - q_len)
    got = attention.paged_attention(*batch.args(pool), 0.125, canonical=False, **batch.new_kv(pool, new_kv))
    _close(got, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


def test_tensor_descriptors_need_aligned_rows() -> None:
    """TMA descriptors over the step's own K/V only where the device has them and the rows are
    16-byte aligned (the tests above run both kinds of load)."""
    pool = Pool(8, 2, 64, torch.bfloat16, seed=3)
    seqs = [(pool.add(*pool.random_kv(40)), 40, torch.zeros(40, 4, 64))]
    fused, strided = (pool.new_kv(seqs, layout) for layout in ("fused", "strided"))
    descriptors = attention._tensor_descriptors(*fused, 64, 64)
    assert all(d is not None for d in descriptors) == attention._has_tma(DEVICE)
    assert attention._tensor_descriptors(*strided, 64, 64) == (None, None)


def test_max_lengths_are_optional() -> None:
    """Without host maxima the launch reads them from the device and gives the same result."""
    pool = Pool(80, 2, 64, torch.float32, seed=6)
    batch = mixed_batch(pool, 4, [(200, 1), (90, 12)])
    for canonical in (False, True):
        given = attention.paged_attention(
            *batch.args(pool), 0.125, canonical=canonical, max_query_len=12, max_seq_len=200
        )
        assert torch.equal(attention.paged_attention(*batch.args(pool), 0.125, canonical=canonical), given)


FIRST, MID, LAST = SPLIT - 24, SPLIT + 2, SPLIT + 15
"""Target rows FIRST..LAST straddle the canonical split boundary; MID splits them into chunks."""
EDGES = (0, 127, 128, 299, 800, 895, 896)
"""Earlier target positions also computed as lone decode rows: at and around tile edges."""


Variant = tuple[list[tuple[list[int], int, torch.Tensor]], list[tuple[int, int]]]


def _target_variants(dtype: torch.dtype) -> tuple[Pool, list[Variant]]:
    """Steps that hold the same target positions in different company and shapes.

    Each variant is (sequences of the step, [(index of a target sequence, its first position)]);
    the target's K/V sit twice in the pool, at two different sets of blocks.
    """
    heads, kv_heads, head_dim = 4, 2, 64
    pool = Pool(600, kv_heads, head_dim, dtype, seed=11)
    keys, values = pool.random_kv(LAST + 1)
    home, copy = pool.add(keys, values), pool.add(keys, values)
    q_all = torch.randn(LAST + 1, heads, head_dim, generator=pool.gen).to(dtype)

    def target(blocks: list[int], first: int, last: int) -> tuple[list[int], int, torch.Tensor]:
        return blocks, last + 1, q_all[first : last + 1]

    def other(ctx: int, q_len: int) -> tuple[list[int], int, torch.Tensor]:
        k, v = pool.random_kv(ctx)
        return pool.add(k, v), ctx, torch.randn(q_len, heads, head_dim, generator=pool.gen).to(dtype)

    variants = [
        ([target(home, FIRST, LAST)], [(0, FIRST)]),
        # A fresh prompt's first chunk, and a chunk from a tile boundary: the kernel reads such
        # chunks' keys in whole tiles from the step's own K/V when it has them.
        ([target(copy, 0, 299), other(60, 1)], [(0, 0)]),
        ([other(40, 40), target(home, 768, MID - 1)], [(1, 768)]),
        ([target(copy if p % 2 else home, p, p) for p in EDGES], [(i, p) for i, p in enumerate(EDGES)]),
        ([other(SPLIT + 300, 1), other(100, 30), target(copy, FIRST, LAST), other(50, 1)], [(2, FIRST)]),
        ([other(20, 3), target(home, FIRST, MID - 1)], [(1, FIRST)]),
        ([target(copy, MID, LAST), other(SPLIT + 40, 9)], [(0, MID)]),
        (
            [
                other(33, 1),
                target(home, FIRST, FIRST),
                target(copy, SPLIT, SPLIT),
                other(70, 7),
                target(home, LAST, LAST),
            ],
            [(1, FIRST), (2, SPLIT), (4, LAST)],
        ),
        # Every target position as a lone decode row: decode steps take smaller query blocks
        # than steps with prompt rows, and each row must still get the bits of a prompt chunk.
        (
            [target(copy if p % 2 else home, p, p) for p in range(FIRST, LAST + 1)],
            [(p - FIRST, p) for p in range(FIRST, LAST + 1)],
        ),
    ]
    return pool, variants


GROWING = {"kv_split": 256, "row_splits": 2}
"""Canonical splits that grow within the targets: 256 keys below position 512, 512 below
1,024, then 1,024, so FIRST..LAST straddle a change of split size and the EDGES have one or
two splits of 256 or 512."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("impl", "config"),
    [("triton", {}), ("triton", GROWING), ("reference", {})],
    ids=["triton", "triton-growing-splits", "reference"],
)
def test_canonical_rows_are_bit_identical_in_any_batch(
    dtype: torch.dtype, impl: str, config: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's canonical output depends only on its position and keys: not on the other rows,
    the query tiling, chunking, decode vs prefill, the number of sequences, or block placement."""
    for key, value in config.items():  # canonical constants other than the default
        monkeypatch.setitem(attention.CANONICAL_CONFIG, key, value)
    pool, variants = _target_variants(dtype)
    scale = 0.125
    results: dict[int, list[torch.Tensor]] = {}
    # The Triton kernel also reads prompt chunks' own keys from the step's K/V (aligned or not,
    # by turns) instead of the cache: their rows keep the bits of lone decode rows, which read
    # the cache.
    for i, (seqs, targets) in enumerate(variants):
        batch = make_batch(seqs)
        if impl == "triton":
            prompt = max(len(q) for _, _, q in seqs) > 1
            outs = [
                attention.paged_attention(*batch.args(pool), scale, canonical=True, **batch.new_kv(pool, layout))
                for layout in ((None, ("fused", "strided")[i % 2]) if prompt else (None,))
            ]
        else:  # the CPU backend's schedule: its batched matmuls keep their bits on the CPU only
            outs = [paged_attention_canonical_ref(*(t.cpu() for t in batch.args(pool)), scale)]
        starts = batch.query_start_loc.tolist()
        for s, first in targets:
            for i in range(starts[s], starts[s + 1]):
                results.setdefault(first + i - starts[s], []).extend(out[i] for out in outs)
    assert {p for p, outs in results.items() if len(outs) > 1} >= {FIRST, MID - 1, MID, SPLIT, LAST, *EDGES}
    for pos, outs in results.items():
        for other in outs[1:]:
            assert torch.equal(outs[0], other), f"position {pos} changed bits with the batch"


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [(torch.float32, 6, 2, 64), (torch.bfloat16, 6, 2, 64), (torch.float32, 4, 1, 32)],
)
def test_canonical_reference_rows_keep_their_bits_alone_among_others_and_chunked(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's canonical attention: every position of a 300-token prompt (5 tiles) gets the
    bits it gets as a lone decode when its prompt is chunked in 1..300 rows, beside 0..5 other
    sequences (decodes and chunks), whether its rows read their own keys or share their
    sequence's (``CANONICAL_SHARED_ROWS``), and however the rows are grouped (``CANONICAL_CHUNK``)."""
    ctx, scale = 300, 0.125
    pool = Pool(160, kv_heads, head_dim, dtype, seed=31 + heads, device=CPU)
    blocks = pool.add(*pool.random_kv(ctx))
    q_all = torch.randn(ctx, heads, head_dim, generator=pool.gen).to(dtype)
    others = []
    for other_ctx, q_len in [(70, 1), (200, 9), (5, 5), (130, 1), (64, 2)]:
        q = torch.randn(q_len, heads, head_dim, generator=pool.gen).to(dtype)
        others.append((pool.add(*pool.random_kv(other_ctx)), other_ctx, q))

    def rows(first: int, last: int, company: int) -> torch.Tensor:
        """Positions ``first .. last`` of the prompt, as one chunk placed among ``company`` others."""
        seqs = others[:company]
        seqs.insert(company // 2, (blocks, last + 1, q_all[first : last + 1]))
        batch = make_batch(seqs, CPU)
        start = int(batch.query_start_loc[company // 2])
        return paged_attention_canonical_ref(*batch.args(pool), scale)[start : start + last + 1 - first]

    alone = torch.cat([rows(p, p, 0) for p in range(ctx)])
    assert attention_ref.CANONICAL_SHARED_ROWS in range(2, 65)
    for grouped in (False, True):
        if grouped:  # a few (row, tile) pairs, and a few rows of a shared sequence, per group
            monkeypatch.setattr(attention_ref, "CANONICAL_CHUNK", 3 * 64 * 64 * heads)
        for i, size in enumerate(
            (1, 3, attention_ref.CANONICAL_SHARED_ROWS - 1, attention_ref.CANONICAL_SHARED_ROWS, 13, 64, ctx)
        ):
            chunks = [rows(a, min(a + size, ctx) - 1, (i + a) % 6) for a in range(0, ctx, size)]
            assert torch.equal(torch.cat(chunks), alone), f"chunks of {size} rows, grouped={grouped}"


def test_torch_backend_gives_each_sequence_its_schedule_and_every_layer_the_same_split() -> None:
    """The CPU backend with per-sequence flags: canonical sequences get the bits of an
    all-canonical batch, fast ones agree with the fast reference; the split it makes in the
    first layer (``meta.memo``) serves the next layers, whatever their K/V."""
    pool = Pool(260, 2, 64, torch.bfloat16, seed=41, device=CPU)
    shapes = [(300, 1), (37, 37), (130, 5), (1, 1), (200, 12), (90, 1)]
    batch = mixed_batch(pool, 4, shapes)
    batch.q = batch.q.to(torch.bfloat16)
    flags = torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(batch.q), dtype=torch.int64),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        max_query_len=37,
        max_seq_len=300,
        canonical=flags,
        schedules=(True, True),
    )
    backend, starts = TorchAttentionBackend(), batch.query_start_loc.tolist()
    for layer in range(2):
        if layer:
            pool.k, pool.v = pool.v.clone(), pool.k.clone()  # another layer: the same rows, other keys
        got = backend.attend(batch.q, pool.k, pool.v, meta, 0.125)
        canon = paged_attention_canonical_ref(*batch.args(pool), 0.125)
        for s, flag in enumerate(flags.tolist()):
            rows = slice(starts[s], starts[s + 1])
            if flag:
                assert torch.equal(got[rows], canon[rows]), f"sequence {s}, layer {layer}"
        _close(got, paged_attention_ref(*batch.args(pool), 0.125), torch.bfloat16)
    assert list(meta.memo) == [backend.name]


@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (1, 64), (8, 32)])
def test_canonical_reference_gemms_ignore_batch_count_slot_and_stride(group: int, head_dim: int) -> None:
    """What the canonical reference's bits rest on: each matrix of a float32 ``torch.bmm``, at
    its shapes (``group x head_dim`` by ``head_dim x tile``, ``group x tile`` by ``tile x
    head_dim``), gets the same bits at every batch count, in every slot, and with the other
    operand broadcast at batch stride 0."""
    gen = torch.Generator().manual_seed(group)
    tile, count = attention_ref.CANONICAL_KV_TILE, 300
    q = torch.randn(count, group, head_dim, generator=gen)
    p = torch.rand(count, group, tile, generator=gen)
    keys = torch.randn(count, tile, head_dim, generator=gen)
    for a, b in ((q, keys.transpose(1, 2)), (p, keys)):
        alone = torch.cat([torch.bmm(a[i : i + 1], b[i : i + 1]) for i in range(count)])
        for n in (2, 3, 5, 16, 31, 64, 127, count):
            assert torch.equal(torch.bmm(a[:n], b[:n]), alone[:n]), f"{n} matrices"
        perm = torch.randperm(count, generator=gen)
        assert torch.equal(torch.bmm(a[perm], b[perm]), alone[perm])
        shared = torch.cat([torch.bmm(a[i : i + 1], b[:1]) for i in range(count)])
        for n in (1, 2, 7, count):
            assert torch.equal(torch.bmm(a[:n], b[0].expand(n, *b.shape[1:])), shared[:n]), f"{n} at stride 0"


@pytest.mark.parametrize("by_sequence_from", [1, 1 << 20], ids=["row-sum-by-sequence", "matrix-sum-every-row"])
@pytest.mark.parametrize("shapes", [[(SPLIT + 60, 1), (300, 1), (40, 1), (SPLIT + 9, 1)], mixed_shapes(True)])
def test_sequences_take_their_own_schedule_in_one_batch(
    shapes: list[tuple[int, int]], by_sequence_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-sequence flags: canonical sequences get the bits they get in an all-canonical
    batch. Decode-only batches share one launch, whose programs branch on their sequence's flag
    around the row sum or (few sequences) sum every row on the matrix unit: either way its fast
    rows may take another spread than an all-fast batch's, so only their values are checked.
    Batches with prompt chunks launch the two schedules separately, and their fast rows get the
    bits of an all-fast batch."""
    monkeypatch.setattr(attention, "_SUM_BY_SEQUENCE_FROM", by_sequence_from)
    pool = Pool(260, 2, 64, torch.bfloat16, seed=21)
    batch = mixed_batch(pool, 4, shapes)
    batch.q = batch.q.to(torch.bfloat16)
    flags = torch.tensor([i % 2 for i in range(len(shapes))], dtype=torch.int32, device=DEVICE)
    kw = dict(max_query_len=max(n for _, n in shapes), max_seq_len=max(c for c, _ in shapes))
    served: list[tuple[int, bool]] = []
    launch = attention._launch
    monkeypatch.setattr(
        attention, "_launch",
        lambda batch, one: served.append((one.serve, one.attention.constants["BY_SEQUENCE"])) or launch(batch, one),
    )
    mixed = attention.paged_attention(*batch.args(pool), 0.125, canonical=flags, **kw)
    decode = kw["max_query_len"] == 1
    separate = [(attention._SERVE_FAST, False), (attention._SERVE_CANONICAL, False)]
    assert sorted(served) == ([(attention._SERVE_BOTH, by_sequence_from == 1)] if decode else separate)
    canon = attention.paged_attention(*batch.args(pool), 0.125, canonical=True, **kw)
    fast = attention.paged_attention(*batch.args(pool), 0.125, canonical=False, **kw)
    starts = batch.query_start_loc.tolist()
    for s in range(len(shapes)):
        rows = slice(starts[s], starts[s + 1])
        if s % 2 or not decode:
            assert torch.equal(mixed[rows], (canon if s % 2 else fast)[rows]), f"sequence {s}"
    _close(mixed, paged_attention_ref(*batch.args(pool), 0.125), torch.bfloat16)


@pytest.mark.parametrize("deterministic", ["decodes", "prompts"])
def test_each_part_of_a_step_launches_only_the_schedules_it_holds(
    deterministic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told which schedules a step's decodes and its prompt rows take (``part_schedules``), each
    launch runs only those: no canonical prompt launch when the deterministic rows all decode,
    a fast decode launch (``tl.sum``) when they are all prompt rows. Canonical rows keep the
    bits they get when the launch is told nothing."""
    monkeypatch.setattr(attention, "_DECODE_LAUNCH_FROM", 2)
    pool = Pool(260, 2, 64, torch.bfloat16, seed=31)
    batch = mixed_batch(pool, 4, [(SPLIT + 60, 1), (70, 1), (37, 37), (SPLIT + 4, 12)])
    batch.q = batch.q.to(torch.bfloat16)
    host = [1, 0, 0, 0] if deterministic == "decodes" else [0, 0, 1, 0]
    flags = torch.tensor(host, dtype=torch.int32, device=DEVICE)
    kw = dict(max_query_len=37, max_seq_len=SPLIT + 60, num_decodes=2, **batch.new_kv(pool, "fused"))
    parts = ((not all(host[:2]), any(host[:2])), (not all(host[2:]), any(host[2:])))
    launches: list[tuple[bool, int]] = []
    launch = attention._launch
    monkeypatch.setattr(
        attention, "_launch", lambda batch, one: launches.append((one.sched.prompt, one.serve)) or launch(batch, one)
    )
    told = attention.paged_attention(*batch.args(pool), 0.125, canonical=flags, part_schedules=parts, **kw)
    fast, canonical, both = attention._SERVE_FAST, attention._SERVE_CANONICAL, attention._SERVE_BOTH
    if deterministic == "decodes":
        assert sorted(launches) == [(False, both), (True, fast)]
    else:
        assert sorted(launches) == [(False, fast), (True, fast), (True, canonical)]
    launches.clear()
    untold = attention.paged_attention(*batch.args(pool), 0.125, canonical=flags, **kw)
    assert sorted(launches) == [(False, both), (True, fast), (True, canonical)]
    starts = batch.query_start_loc.tolist()
    for s, flag in enumerate(host):
        if flag:
            assert torch.equal(told[starts[s] : starts[s + 1]], untold[starts[s] : starts[s + 1]]), f"sequence {s}"
    _close(told, paged_attention_ref(*batch.args(pool), 0.125), torch.bfloat16)


@pytest.mark.parametrize("schedule", ["fast", "canonical", "mixed"])
def test_leading_one_row_sequences_beside_prompt_rows_get_a_decode_launch(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told that a step's first sequences have one row (``num_decodes``), a step with prompt
    rows gives them a decode-shaped launch (from ``_DECODE_LAUNCH_FROM`` of them on), and its
    prompt launch covers the rest: each launch writes its own rows only; canonical rows keep
    the bits they get in one prompt launch, fast rows the values."""
    monkeypatch.setattr(attention, "_DECODE_LAUNCH_FROM", 2)
    pool = Pool(260, 2, 64, torch.bfloat16, seed=29)
    decodes, prompts = [(SPLIT + 60, 1), (1, 1)], [(37, 37), (50, 0), (SPLIT + 4, 12), (130, 5)]
    shapes = decodes + prompts
    batch = mixed_batch(pool, 4, shapes)
    batch.q = batch.q.to(torch.bfloat16)
    flags = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    canonical = {"fast": False, "canonical": True, "mixed": flags}[schedule]
    kw = dict(max_query_len=37, max_seq_len=SPLIT + 60, **batch.new_kv(pool, "fused"))
    decode_rows = torch.arange(len(batch.q), device=DEVICE) < len(decodes)
    kinds: list[tuple[int, bool]] = []
    launch = attention._launch

    def only(prompt: bool | None) -> Callable[..., None]:  # only the prompt launches, only the decode one, or all
        def run(batch: Any, one: Any) -> None:
            kinds.append((one.rows.seq_lens.shape[0], one.sched.prompt))
            if prompt in (None, one.sched.prompt):
                launch(batch, one)

        return run

    for prompt in (True, False, None):
        kinds.clear()
        monkeypatch.setattr(attention, "_launch", only(prompt))
        out = torch.full_like(batch.q, float("nan"))
        attention.paged_attention(*batch.args(pool), 0.125, canonical=canonical, out=out, num_decodes=2, **kw)
        written = ~out.isnan().any(dim=(1, 2))
        expected = torch.ones_like(decode_rows) if prompt is None else decode_rows != prompt
        assert torch.equal(written, expected), f"rows written by {prompt} launches"
    assert sorted(kinds) == [(len(decodes), False)] + [(len(prompts), True)] * (1 if schedule != "mixed" else 2)
    kinds.clear()
    one = attention.paged_attention(*batch.args(pool), 0.125, canonical=canonical, num_decodes=1, **kw)
    assert {k for k, _ in kinds} == {len(shapes)}, "one decode is left in the prompt launch"
    starts = batch.query_start_loc.tolist()
    for s in range(len(shapes)):
        rows = slice(starts[s], starts[s + 1])
        if schedule == "canonical" or schedule == "mixed" and flags[s]:
            assert torch.equal(out[rows], one[rows]), f"sequence {s}"
    _close(out, paged_attention_ref(*batch.args(pool), 0.125), torch.bfloat16)


def test_one_plan_serves_every_layer_of_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend plans a step's launches in its first layer (``AttentionPlan``, kept in
    the metadata's memo) and every layer runs them: each gets the bits of a call that plans for
    itself, though the layers share the plan's partials."""
    monkeypatch.setattr(attention, "_DECODE_LAUNCH_FROM", 2)
    pool = Pool(260, 2, 64, torch.bfloat16, seed=37)
    batch = mixed_batch(pool, 4, [(SPLIT + 60, 1), (70, 1), (37, 37), (SPLIT + 4, 12)])
    batch.q = batch.q.to(torch.bfloat16)
    q, k_cache, v_cache, tables, seq_lens, starts = batch.args(pool)
    flags = torch.tensor([1, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    kv = batch.new_kv(pool, "fused")
    sizes = dict(max_query_len=37, max_seq_len=SPLIT + 60, num_decodes=2)
    meta = AttentionMetadata(torch.zeros(len(q), dtype=torch.int64), tables, seq_lens, starts, canonical=flags, **sizes)
    plans: list[attention.AttentionPlan] = []
    plan = triton_backend.plan_attention
    monkeypatch.setattr(triton_backend, "plan_attention", lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1])
    backend = TritonAttentionBackend()
    gen = torch.Generator().manual_seed(5)
    for layer_q, scale in ((q, 0.125), (torch.randn(q.shape, generator=gen).to(q), 0.125), (q, 0.3)):
        got = backend.attend(layer_q, k_cache, v_cache, meta, scale, **kv)
        alone = attention.paged_attention(layer_q, k_cache, v_cache, tables, seq_lens, starts, scale, canonical=flags,
                                          **sizes, **kv)  # fmt: skip
        assert torch.equal(got, alone)
    assert len(plans) == 1 and plans[0].slots > 1  # planned once; its rows split, so the partials are shared
    # Compiled, the second layer launches the first layer's kernels directly (``Relaunch``); the
    # third one's scale differs, so only its combines do. The interpreter keeps no compiled kernel.
    combines = sum(one.combine is not None for one in plans[0].launches)
    direct = len(plans[0].launches) + 2 * combines if DEVICE.type == "cuda" else 0
    assert sum(one.relaunch.direct for one in plans[0].launches) == direct


class _Compiled(CompiledKernel):
    """Stands in for a compiled kernel: records the launches made through it."""

    def __init__(self, launches: list[tuple[str, tuple[int, ...], tuple[Any, ...]]]) -> None:
        self.launches = launches

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args: self.launches.append(("direct", grid, args))


class _Jit:
    """Stands in for a JIT kernel of parameters ``a, b, n, C``: a JIT call returns a new compiled kernel."""

    arg_names = ["a", "b", "n", "C"]

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., _Compiled]:
        def call(*args: Any, **constants: Any) -> _Compiled:
            self.launches.append(("jit", grid, (*args, *constants.values())))
            return _Compiled(self.launches)

        return call


def test_relaunch_launches_directly_only_what_the_jit_call_would_have_chosen() -> None:
    """``Relaunch`` runs a kernel a JIT call returned for later calls whose arguments specialise
    alike, with the constants in parameter order; a call whose tensor alignment, dtype or other
    value (a Gluon descriptor's shape or shared layout) differs goes through the JIT call, and
    its kernel is then the one kept. (The compiled
    path itself runs in the GPU tests: ``test_one_plan_serves_every_layer_of_a_step``.)"""
    kernel, relaunch = _Jit(), Relaunch()
    x = torch.zeros(64, dtype=torch.bfloat16)
    y = torch.zeros(64, dtype=torch.bfloat16)
    relaunch(kernel, (2, 1), (x, None, 7), {"C": 3, "num_warps": 4})
    relaunch(kernel, (2, 1), (y, None, 7), {"C": 3, "num_warps": 4})  # another tensor, alike
    # A compiled kernel's launcher reads three grid axes: a grid of two gets the third.
    assert kernel.launches == [("jit", (2, 1), (x, None, 7, 3, 4)), ("direct", (2, 1, 1), (y, None, 7, 3))]
    assert relaunch.direct == 1
    # Two Gluon descriptors alike but for their shared layout's swizzle.
    wide, narrow = (gl.NVMMASharedLayout(swizzle, 16, 2) for swizzle in (64, 32))
    for args, constants in (
        ((x[1:], None, 7), {"C": 3}),  # 2 bytes off 16-byte alignment
        ((x.float(), None, 7), {"C": 3}),
        ((x, None, 8), {"C": 3}),
        ((x, y, 7), {"C": 3}),
        ((x, None, 7), {"C": 4}),
        ((GluonDescriptor(x.view(2, 32), [2, 32], [32, 1], [8, 32], wide), None, 7), {"C": 3}),
        ((GluonDescriptor(x.view(2, 32), [2, 32], [32, 1], [8, 32], narrow), None, 7), {"C": 3}),
    ):
        kernel.launches.clear()
        relaunch(kernel, (2, 1), args, {**constants, "num_warps": 4})
        relaunch(kernel, (2, 1), args, {**constants, "num_warps": 4})
        assert [kind for kind, _, _ in kernel.launches] == ["jit", "direct"], (args, constants)
    assert relaunch.direct == 8


def test_canonical_bits_do_not_depend_on_how_splits_are_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program folds one split (a thin batch: the combine kernel folds the rest, its head
    dimensions spread over several programs or not) or every split of its rows (a full batch):
    the same left fold of the same split states either way."""
    pool = Pool(600, 2, 64, torch.float32, seed=23)
    batch = mixed_batch(pool, 4, [(3 * SPLIT + 70, 1), (2 * SPLIT + 5, 9), (SPLIT - 3, 1)])
    outs = []
    for target in (1 << 20, 1):  # programs wanted: every split its own / one program folds them all
        monkeypatch.setattr(attention, "_target_programs", lambda device, prompt=False, target=target: target)
        sched = attention._canonical_schedule(2, len(batch.q), 3, 2, 9, 3 * SPLIT + 70, DEVICE)
        outs.append((sched.group, attention.paged_attention(*batch.args(pool), 0.125, canonical=True)))
    (spread, a), (folded, b) = outs
    assert spread == 1 and folded == 4
    assert torch.equal(a, b)
    monkeypatch.setattr(attention, "_target_programs", lambda device, prompt=False: 1 << 20)
    for dims in (16, 64):  # a head's 64 dimensions folded by 4 programs, or by one
        monkeypatch.setattr(attention, "_COMBINE_DIMS", dims)
        assert torch.equal(attention.paged_attention(*batch.args(pool), 0.125, canonical=True), a), f"{dims} dims"
    _close(a, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


@pytest.mark.parametrize("decode", [False, True], ids=["prompt rows", "decode"])
def test_canonical_bits_of_a_head_do_not_depend_on_the_heads_beside_it(decode: bool) -> None:
    """A rank under tensor parallelism holds some KV heads and their query heads, in a cache of
    its own: each head's canonical rows get the bits they get beside all the others, as
    TP-invariant sums promise a deterministic request at every TP size."""
    pool = Pool(600, 4, 64, torch.float32, seed=41)
    shapes = [(SPLIT + 60, 1), (300, 1), (2 * SPLIT + 3, 1)] if decode else mixed_shapes(True)
    batch = mixed_batch(pool, 8, shapes)
    whole = attention.paged_attention(*batch.args(pool), 0.125, canonical=True)
    for size, rank in ((2, 0), (2, 1), (4, 3)):  # GQA 2: KV heads 0-1 / 2-3 / 3, query heads twice as many
        kv, heads = slice(rank * 4 // size, (rank + 1) * 4 // size), slice(rank * 8 // size, (rank + 1) * 8 // size)
        k, v = pool.k[:, :, kv].contiguous(), pool.v[:, :, kv].contiguous()
        q = batch.q[:, heads].contiguous()
        part = attention.paged_attention(q, k, v, *batch.args(pool)[3:], 0.125, canonical=True)
        assert torch.equal(part, whole[:, heads]), f"TP={size}, rank {rank}"


def test_decode_rows_fold_many_short_splits_with_the_bits_of_one_split_a_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode rows of up to 13 two-tile splits: each split its own program (the combine folds
    their partials), a program for every 1,024 keys (a full batch's least: four splits folded
    in one loop over their tiles, each split finished at its last), or one program for all:
    the same bits."""
    monkeypatch.setitem(attention.CANONICAL_CONFIG, "kv_split", 256)
    pool = Pool(700, 2, 64, torch.float32, seed=37)
    batch = mixed_batch(pool, 4, [(3 * SPLIT + 70, 1), (2 * SPLIT + 5, 1), (300, 1), (256, 1)])
    groups, outs = [], []
    for target, sms in ((1 << 20, 1 << 10), (1 << 20, 1), (1, 1)):  # thin batch; full; full, few programs
        monkeypatch.setattr(attention, "_target_programs", lambda device, prompt=False, target=target: target)
        monkeypatch.setattr(attention, "_num_sms", lambda device, sms=sms: sms)
        groups.append(attention._canonical_schedule(2, 4, 4, 2, 1, 3 * SPLIT + 70, DEVICE).group)
        outs.append(attention.paged_attention(*batch.args(pool), 0.125, canonical=True))
    assert groups == [1, attention._FULL_MIN_PROGRAM_KEYS // 256, 13]
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
    _close(outs[0], paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


@pytest.mark.parametrize("canonical", [False, True], ids=["fast", "canonical"])
def test_a_decode_launch_folds_its_own_partials_with_the_combine_kernels_bits(
    canonical: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thin decode batch spreads each row over several programs; the last of a row's
    programs to finish folds their partials in the launch (``_fold_if_last``): no combine
    launch, the bits the combine kernel gives, and every ticket back at 0 for the next launch."""
    monkeypatch.setattr(attention, "_target_programs", lambda device, prompt=False: 1 << 20)
    pool = Pool(600, 2, 64, torch.float32, seed=43)
    batch = mixed_batch(pool, 4, [(3 * SPLIT + 70, 1), (2 * SPLIT + 5, 1), (300, 1)])
    combines = []
    kernel = attention._combine_kernel

    class Counted:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
            combines.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_combine_kernel", Counted())
    outs = []
    for tickets in (attention._TICKETS, 0):  # the launch folds / the combine kernel does
        monkeypatch.setattr(attention, "_TICKETS", tickets)
        outs.append(attention.paged_attention(*batch.args(pool), 0.125, canonical=canonical))
        assert len(combines) == (tickets == 0), combines
    assert torch.equal(outs[0], outs[1])
    assert not any(row.any() for row in attention._tickets(DEVICE))
    _close(outs[0], paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


def test_canonical_splits_grow_with_the_row_so_no_row_has_more_than_row_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split size is a function of the row's position: ``kv_split`` doubled at each
    ``row_splits`` splits. The host's partial slots (the most splits of any row up to a length)
    agree with walking every position. A GQA group whose prompt blocks could straddle a change
    of size keeps one size."""
    monkeypatch.setitem(attention.CANONICAL_CONFIG, "kv_split", 256)
    monkeypatch.setitem(attention.CANONICAL_CONFIG, "row_splits", 4)
    assert attention._row_splits(4) == 4 and attention._row_splits(3) == 0
    assert [attention._canonical_split(p, 4) for p in (0, 1023, 1024, 2047, 2048, 4095, 4096)] == [
        256, 256, 512, 512, 1024, 1024, 2048
    ]
    assert attention._canonical_split(10**6, 0) == 256
    most = 0
    for pos in range(20_000):
        most = max(most, pos // attention._canonical_split(pos, 4) + 1)
        assert attention._canonical_row_splits(pos + 1, 4) == most
    assert most == 4


def test_canonical_sequences_deal_their_own_splits_in_a_launch_sized_for_longer_ones() -> None:
    """A decode launch sized for far more keys than its sequences hold (a CUDA graph's): the
    launch gives each row several programs, each folding several splits, and a short sequence
    deals its few splits out to those programs one each. Its rows keep the bits of a launch
    sized for the batch's own lengths."""
    pool = Pool(700, 2, 64, torch.float32, seed=29)
    shapes = [(3 * SPLIT - 100, 1), (SPLIT + 50, 1), (2 * SPLIT + 7, 1), (400, 1)]
    batch = mixed_batch(pool, 4, shapes)
    limit = 16 * SPLIT
    sched = attention._canonical_schedule(2, 4, 4, 2, 1, limit, DEVICE)
    programs = attention._cdiv(attention._cdiv(limit, SPLIT), sched.group)
    assert sched.group > 1 and programs > 1, "the launch must fold several splits a program on several programs"
    assert attention._cdiv(3, programs) == 1, "so the longest sequence's 3 splits take one program each"
    sized = attention.paged_attention(*batch.args(pool), 0.125, canonical=True, max_query_len=1, max_seq_len=limit)
    own = attention.paged_attention(*batch.args(pool), 0.125, canonical=True, max_query_len=1)
    assert torch.equal(sized, own)
    _close(sized, paged_attention_ref(*batch.args(pool), 0.125), torch.float32)


def _lowered_for_sm90(*flags: str) -> dict:
    """What ``tests/sm90_shared_memory.py`` reports, run in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_shared_memory.py")
    run = subprocess.run([sys.executable, str(script), *flags], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_launches_fit_in_sm90_shared_memory() -> None:
    """Both schedules' prompt and decode launches, float32 and bf16, ask for no more shared
    memory than sm_90 grants a program, lowered for sm_90 on this machine as the H200
    specialises them (``tests/sm90_shared_memory.py``, a process without the interpreter). The
    canonical prompt launch asked for 263 KB in float32 before it ran one stage, and the H200
    refused it. A bf16 decode program's share sets ``_DECODE_PROGRAMS_AT_ONCE``."""
    found = _lowered_for_sm90()
    assert {name.rsplit(" ", 1)[0] for name in found} >= {
        "canonical prompt", "fast prompt", "hopper prompt", "hopper canonical prompt", "canonical decode",
        "fast decode",
    }, found
    assert all(0 < need <= SM90_SHARED_BYTES for need in found.values()), found
    decode = found["fast decode bfloat16"]
    assert SM90_SHARED_BYTES // decode == attention._DECODE_PROGRAMS_AT_ONCE, found


def test_the_fast_prompt_launches_keep_their_wgmma_asynchronous() -> None:
    """ptxas for sm_90a (Triton's own, run on this machine) keeps the wgmma instructions of the
    fast prompt launches asynchronous, and the Gluon ones (``hopper_prefill``) launchable: a
    program's registers (every partition's threads, the load warp's padded to a warpgroup)
    within sm_90's 65,536, where 224 a thread compiled and was refused at launch on the H100
    (2026-12-07); both unspilled (the canonical one's fold's values in shared memory: in
    registers they spilled 1,848 bytes a thread, and folding before a split's first softmax
    184). Their wgmma descriptors are canonical (base offset 0): the Gluon canonical row sum's
    were not, and its rows came out wrong on the H100 (2026-12-07). The Triton canonical one's are serialised
    (advisory C7515: each waits for the one before) by the branch in its tile loop that folds a
    finished split and restarts the next; restarting and folding by selects instead kept them
    asynchronous but made the launch 1.04-1.09x slower on the H200 (2026-12-03), so it keeps
    the branch."""
    found = _lowered_for_sm90("--registers")
    for launch in ("fast prompt bfloat16", "hopper prompt bfloat16", "hopper canonical prompt bfloat16"):
        assert found[launch]["registers"] > 0, found
        assert found[launch]["registers"] * found[launch]["threads"] <= 65_536, found
        assert not found[launch]["wgmma_serialized"], found
        assert found[launch]["wgmma_descriptors"] > 0 and not found[launch]["descriptor_base_offsets"], found
    assert found["hopper prompt bfloat16"]["threads"] == found["hopper canonical prompt bfloat16"]["threads"] == 384
    assert found["hopper prompt bfloat16"]["spill_bytes"] == 0, found
    assert found["hopper canonical prompt bfloat16"]["spill_bytes"] == 0, found


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_canonical_gluon_fold_moves_through_shared_memory_without_bank_conflicts(head_dim: int) -> None:
    """The canonical Gluon walk stores and loads its fold's weighted values (a warpgroup's
    wgmma accumulator) once a split through shared memory in ``FOLD_LAYOUT``: Triton's own
    count of excess wavefronts an access is 0 there, and 3 unswizzled (its first layout, whose
    launch ran at 0.40 of the matmul rate against the fast kernel's 0.70; H100, 2026-12-07)."""
    context = ir.context()
    ir.load_dialects(context)
    builder = GluonOpBuilder(context)
    accumulator = hopper_prefill._mma_layout.fn(head_dim)._to_ir(builder)

    def conflicts(layout: gl.SharedLayout) -> int:
        return builder.get_shared_bank_conflicts(accumulator, layout._to_ir(builder), [64, head_dim], 32)

    assert conflicts(hopper_prefill.FOLD_LAYOUT.value) == 0
    assert conflicts(gl.SwizzledSharedLayout(1, 1, 1, [1, 0])) == 3
