"""Paged attention on real model shapes: correctness, canonical bit-identity, then speed vs the floor.

Checks the Triton kernels against the torch references at Llama-3.1-8B (32 q heads, 8 KV heads)
and Qwen3-0.6B (16/8) attention shapes (head_dim 128, bf16, block_size 16), checks that
canonical rows keep their bits in differently composed batches, then times decode steps
(batch x context; fast, canonical, and riding: every tenth sequence canonical; each also
launched for the model's longest, as a CUDA graph of the engine is), prefills,
a chunk after a cached prefix, and prompt steps with decodes beside their prompt rows (the
decodes in a launch of their own, as the engine runs them, and in the prompt launch), for
both schedules (on sm_90 prefills also as ``hopper_prefill``'s Gluon kernels, "fast gluon" and
"canonical gluon"; the engine runs the fast one with ``SID_HOPPER_PREFILL=1``, the canonical
one not, being no quicker: its rows' bits against the Triton kernel's are reported, and it is
timed only where they agree), with
``triton.testing.do_bench`` (median).
The floor is bytes moved over the HBM bandwidth measured in the same run (a ``sum`` over a
~4 GB bf16 tensor); for prefill also FLOPs over the bf16 matmul rate measured likewise.

    python benchmarks/attention.py [--out DIR] [--kinds decode,prefill,mixed] [--models llama-3.1-8b]  # GPU
    python benchmarks/attention.py --smoke        # tiny sizes, CPU interpreter included
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the interpreter switch)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_args, write_json  # noqa: E402

from sid.kernels.attention_ref import paged_attention_canonical_ref, paged_attention_ref  # noqa: E402
from sid.kernels.kv_store import store_kv  # noqa: E402
from sid.kernels import hopper_prefill  # noqa: E402
from sid.kernels import paged_attention as kernels  # noqa: E402
from sid.kernels.paged_attention import CANONICAL_CONFIG, paged_attention  # noqa: E402

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
TOLERANCE = 2e-2
MEMORY_CAP = 60e9
"""Largest KV cache a timing case may allocate (bytes)."""
RIDE_EVERY = 10
"""The ``riding`` decode rows: every tenth sequence (the first included) attends canonically,
the rest fast, as deterministic rows ride among normal ones (one launch serves both)."""
SPLIT = CANONICAL_CONFIG["kv_split"]
"""Canonical split boundary: the checks put rows on both sides of it."""
SMOKE_CONFIG = {"kv_tile": 32, "kv_split": 64}
"""Canonical constants under ``--smoke``: the interpreter runs one program per token stored and
per tile, too slowly for contexts past the real split (4,096 keys)."""
SMOKE_SPLIT = SMOKE_CONFIG["kv_split"]
KINDS = {"decode", "prefill", "mixed"}
"""The timed cases (``--kinds``)."""


@dataclass(frozen=True)
class Sizes:
    models: dict[str, tuple[int, int, int]]
    """name -> (q heads, KV heads, head_dim)."""
    check_shapes: list[tuple[int, int]]
    """(context, query rows) of the mixed correctness batch."""
    target: tuple[int, int]
    """Canonical bit-identity target: context length, number of trailing rows checked."""
    batches: list[int]
    contexts: list[int]
    prefill: list[tuple[int, int, int]]
    """Prefill timings: (sequences, chunk tokens each, cached prefix tokens before the chunk)."""
    mixed: list[tuple[int, int, int, int]]
    """Prompt steps with decodes: (decodes, their context, fresh prompts, prompt tokens each)."""
    graph_limit: int
    """Keys a decode step is also launched for, as the engine's CUDA graphs are (the model's
    longest: Qwen3's 40,960), whatever its sequences hold (``limit_graph_ms``)."""
    bandwidth_bytes: int
    matmul_n: int


FULL = Sizes(
    models={"llama-3.1-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)},
    check_shapes=[(8192, 1), (4096, 1), (2 * SPLIT + 500, 512), (700, 700), (33, 1), (1500, 0), (2100, 37)],
    target=(3 * SPLIT + 28, 100),
    batches=[1, 8, 64, 256],
    contexts=[512, 8192, 32768],
    prefill=[(8, 2048, 0), (2, 8192, 0), (1, 32768, 0), (1, 2048, 16384)],
    mixed=[(200, 700, 8, 500), (250, 900, 2, 1800), (32, 700, 1, 128)],
    graph_limit=40960,
    bandwidth_bytes=4 << 30,
    matmul_n=8192,
)
SMOKE = Sizes(
    models={"tiny-gqa4": (4, 1, 32)},
    check_shapes=[(SMOKE_SPLIT + 20, 1), (50, 12), (24, 0), (SMOKE_SPLIT + 4, 9)],
    target=(SMOKE_SPLIT + 16, 24),
    batches=[1, 2],
    contexts=[64, SMOKE_SPLIT + 64],
    prefill=[(2, 32, 0), (1, 16, 48)],
    mixed=[(16, 20, 1, 24)],
    graph_limit=4 * SMOKE_SPLIT,
    bandwidth_bytes=64 << 20,
    matmul_n=256,
)


def bench(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds of ``fn``: do_bench on the GPU, one wall-clock run in smoke mode."""
    if not smoke:
        return triton.testing.do_bench(fn, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


GRAPH_CALLS = 16
"""Calls captured in one CUDA graph per timing, as a step's graph holds one per layer. One call
a graph would add the replay's own cost (4.5 us against 1.1 us a kernel in 16-call graphs,
H200), which no layer of a real step pays."""


def bench_graph(fn: Callable[[], object], smoke: bool) -> float | None:
    """Median milliseconds of one call of ``fn`` replayed from a CUDA graph of ``GRAPH_CALLS``
    calls (as the engine runs a step's layers): GPU time without Python launch overhead. None
    in smoke mode."""
    if smoke:
        return None
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") / GRAPH_CALLS


def measure_bandwidth(sizes: Sizes, device: torch.device, smoke: bool) -> float:
    """HBM read bandwidth in bytes/s: a sum over one large bf16 tensor."""
    x = torch.ones(sizes.bandwidth_bytes // 2, dtype=torch.bfloat16, device=device)
    ms = bench(lambda: x.sum(), smoke)
    return sizes.bandwidth_bytes / (ms * 1e-3)


def measure_matmul(sizes: Sizes, device: torch.device, smoke: bool) -> float:
    """bf16 matmul rate in FLOP/s on random data."""
    n = sizes.matmul_n
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    ms = bench(lambda: a @ b, smoke)
    return 2 * n**3 / (ms * 1e-3)


class Pool:
    """A paged KV pool whose blocks are handed out in shuffled order, leaving holes."""

    def __init__(self, num_blocks: int, kv_heads: int, head_dim: int, device: torch.device) -> None:
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=DTYPE, device=device)
        self.v = torch.full(shape, float("nan"), dtype=DTYPE, device=device)
        self.free = torch.randperm(num_blocks).tolist()
        self.device = device

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Store a context's K/V with the Triton store; returns its block ids."""
        blocks = [self.free.pop() for _ in range(triton.cdiv(len(keys), BLOCK_SIZE))]
        self.free.pop()
        pos = torch.arange(len(keys), device=self.device)
        slots = torch.tensor(blocks, device=self.device)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        store_kv(keys, values, self.k, self.v, slots)
        return blocks

    def random_context(self, length: int) -> list[int]:
        shape = (length, *self.k.shape[2:])
        return self.add(torch.randn(shape, device=self.device), torch.randn(shape, device=self.device))


def batch_args(pool: Pool, seqs: list[tuple[list[int], int, torch.Tensor]]) -> tuple:
    """Kernel arguments for sequences (block ids, context length, query rows); unused entries -1."""
    device = pool.device
    width = max(len(blocks) for blocks, _, _ in seqs) + 1
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for s, (blocks, _, _) in enumerate(seqs):
        table[s, : len(blocks)] = torch.tensor(blocks)
    q_lens = torch.tensor([len(q) for _, _, q in seqs])
    return (
        torch.cat([q for _, _, q in seqs]),
        pool.k,
        pool.v,
        table.to(device),
        torch.tensor([ctx for _, ctx, _ in seqs], dtype=torch.int32, device=device),
        torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(device),
    )


def check_model(sizes: Sizes, heads: int, kv_heads: int, head_dim: int, device: torch.device) -> dict:
    """Both schedules against their references on a mixed batch, and the canonical bit-identity."""
    target_len, target_rows = sizes.target
    contexts = [ctx for ctx, _ in sizes.check_shapes] * 2 + [target_len] * 2
    pool = Pool(sum(triton.cdiv(ctx, BLOCK_SIZE) + 1 for ctx in contexts), kv_heads, head_dim, device)
    scale = head_dim**-0.5

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, heads, head_dim, device=device, dtype=DTYPE)

    args = batch_args(pool, [(pool.random_context(ctx), ctx, rows(q_len)) for ctx, q_len in sizes.check_shapes])
    report = {}
    for canonical, ref in ((False, paged_attention_ref), (True, paged_attention_canonical_ref)):
        out = paged_attention(*args, scale, canonical=canonical)
        err = (out.float() - ref(*args, scale).float()).abs().max().item()
        report["canonical_max_err" if canonical else "fast_max_err"] = err
        assert err < TOLERANCE and not out.isnan().any(), f"{'canonical' if canonical else 'fast'} error {err}"
    # The step's own keys given, as the engine gives them, where the fast prompt launch may run
    # as the Gluon kernel (sm_90): against its reference; the canonical Gluon kernel's rows
    # against the Triton kernel's bits, counted (the engine does not run it yet).
    step = Step.random(heads, kv_heads, head_dim, [ctx for ctx, _ in sizes.check_shapes],
                       [q_len for _, q_len in sizes.check_shapes], device)  # fmt: skip
    step.store()
    fast, canonical, gluon = (torch.empty_like(step.q) for _ in range(3))
    with hopper(True):
        step.attend(fast, False)
    step_args = (step.q, step.k_cache, step.v_cache, step.table, step.seq_lens, step.query_start_loc)
    err = (fast.float() - paged_attention_ref(*step_args, scale).float()).abs().max().item()
    report["fast_own_keys_max_err"] = err
    assert err < TOLERANCE and not fast.isnan().any(), f"fast error {err} with the step's own keys"
    if hopper_prefill.supports(step.q, step.k_cache):
        step.attend(canonical, True)
        step.attend_canonical_gluon(gluon)
        report["canonical_gluon_rows_changed"] = int((gluon != canonical).any(-1).any(-1).sum())
        report["canonical_gluon_max_diff"] = (gluon.float() - canonical.float()).abs().max().item()

    shape = (target_len, kv_heads, head_dim)
    keys, values = torch.randn(shape, device=device), torch.randn(shape, device=device)
    home, copy = pool.add(keys, values), pool.add(keys, values)
    q_all = rows(target_len)
    first = target_len - target_rows
    mid = first + target_rows // 3

    def target(blocks: list[int], lo: int, hi: int) -> tuple[list[int], int, torch.Tensor]:
        return blocks, hi, q_all[lo:hi]

    companions = [(pool.random_context(ctx), ctx, rows(q_len)) for ctx, q_len in sizes.check_shapes[:3]]
    decodes = [target(copy if p % 2 else home, p, p + 1) for p in (first, mid, target_len - 1)]
    variants = [
        ([target(home, first, target_len)], [(0, first)]),
        ([*companions, target(copy, first, target_len)], [(len(companions), first)]),
        ([target(home, first, mid), companions[1]], [(0, first)]),
        ([companions[0], target(copy, mid, target_len)], [(1, mid)]),
        ([*decodes, *companions], [(0, first), (1, mid), (2, target_len - 1)]),
    ]
    for name, attention in (
        ("triton", lambda a: paged_attention(*a, scale, canonical=True)),
        ("reference", lambda a: paged_attention_canonical_ref(*a, scale)),
    ):
        seen: dict[int, torch.Tensor] = {}
        compared = changed = 0
        for seqs, targets in variants:
            args = batch_args(pool, seqs)
            out = attention(args)
            starts = args[5].tolist()
            for s, lo in targets:
                for i in range(starts[s], starts[s + 1]):
                    pos = lo + i - starts[s]
                    if pos in seen:
                        compared += 1
                        changed += not torch.equal(seen[pos], out[i])
                    seen[pos] = out[i]
        report[f"{name}_rows_compared"] = compared
        report[f"{name}_rows_changed"] = changed
    # The torch reference is the CPU backend's schedule; on CUDA its batched matmuls may pick
    # kernels by batch size, so only the Triton kernel is held to bit-identity here.
    assert report["triton_rows_changed"] == 0, "canonical Triton rows changed bits with the batch"
    return report


def decode_case(
    pool_k: torch.Tensor, pool_v: torch.Tensor, heads: int, batch: int, ctx: int, device: torch.device
) -> tuple:
    """A decode step: ``batch`` sequences of ``ctx`` keys in shuffled blocks, one query row each."""
    per_seq = triton.cdiv(ctx, BLOCK_SIZE)
    table = torch.randperm(pool_k.shape[0], device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, heads, pool_k.shape[3], dtype=DTYPE, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, pool_k, pool_v, table, seq_lens, query_start_loc


def time_model(
    sizes: Sizes,
    heads: int,
    kv_heads: int,
    head_dim: int,
    bandwidth: float,
    flops: float,
    device: torch.device,
    smoke: bool,
    kinds: set[str] = KINDS,
    canonical_gluon: bool = False,
) -> list[dict]:
    """Decode steps over the batch x context grid, then the prefill cases, then the mixed steps
    (those of ``kinds``); both schedules. ``canonical_gluon``: the canonical Gluon kernel's rows
    had the Triton kernel's bits in the check, so its prefill is timed too."""
    elem = torch.finfo(DTYPE).bits // 8
    kv_per_token = 2 * kv_heads * head_dim * elem
    cases = [(b, c) for b in sizes.batches for c in sizes.contexts if b * c * kv_per_token <= MEMORY_CAP]
    cases = cases if "decode" in kinds else []
    shape = (max([b * triton.cdiv(c, BLOCK_SIZE) for b, c in cases], default=1), BLOCK_SIZE, kv_heads, head_dim)
    pool_k = torch.randn(shape, dtype=DTYPE, device=device)
    pool_v = torch.randn(shape, dtype=DTYPE, device=device)
    scale = head_dim**-0.5
    rows = []
    for batch, ctx in cases:
        args = decode_case(pool_k, pool_v, heads, batch, ctx, device)
        out = torch.empty_like(args[0])
        floor_bytes = batch * ctx * kv_per_token + 2 * batch * heads * head_dim * elem
        riding = torch.zeros(batch, dtype=torch.int32, device=device)
        riding[::RIDE_EVERY] = 1
        for schedule, canonical in (("fast", False), ("canonical", True), ("riding", riding)):
            both = (batch > 1, True) if schedule == "riding" else None

            def step(limit: int = ctx) -> None:
                paged_attention(*args, scale, canonical=canonical, out=out, max_query_len=1, max_seq_len=limit,
                                schedules=both)

            def step_at_limit() -> None:
                step(max(ctx, sizes.graph_limit))

            rows.append(
                dict(kind="decode", batch=batch, context=ctx, schedule=schedule,
                     ms=bench(step, smoke), graph_ms=bench_graph(step, smoke),
                     limit_ms=bench(step_at_limit, smoke), limit_graph_ms=bench_graph(step_at_limit, smoke),
                     floor_ms=floor_bytes / bandwidth * 1e3)
            )
    del pool_k, pool_v

    for seqs, length, prefix in sizes.prefill if "prefill" in kinds else []:
        rows += time_prefill(heads, kv_heads, head_dim, seqs, length, prefix, bandwidth, flops, device, smoke,
                             canonical_gluon)
    for case in sizes.mixed if "mixed" in kinds else []:
        rows += time_mixed(heads, kv_heads, head_dim, *case, bandwidth, flops, device, smoke)
    return rows


@dataclass
class Step:
    """A step's attention inputs: sequences of ``seq_lens`` keys whose last ``q_lens`` are this
    step's rows, every other key already cached, in shuffled blocks; the step's own K/V is not
    stored yet (``store``)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def random(
        cls, heads: int, kv_heads: int, head_dim: int, seq_lens: list[int], q_lens: list[int], device: torch.device
    ) -> Step:
        seqs, tokens = len(seq_lens), sum(q_lens)
        per_seq = triton.cdiv(max(seq_lens), BLOCK_SIZE)
        shape = (seqs * per_seq + 1, BLOCK_SIZE, kv_heads, head_dim)
        k_cache = torch.randn(shape, dtype=DTYPE, device=device)
        table = torch.randperm(shape[0], device=device)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
        owner = torch.repeat_interleave(torch.arange(seqs), torch.tensor(q_lens)).to(device)
        pos = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, q_lens)]).to(device)
        key = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device=device)
        return cls(
            q=torch.randn(tokens, heads, head_dim, dtype=DTYPE, device=device),
            k_cache=k_cache,
            v_cache=torch.randn_like(k_cache),
            table=table,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
            key=key,
            value=torch.randn_like(key),
            slots=table[owner, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE,
        )

    def store(self) -> None:
        store_kv(self.key, self.value, self.k_cache, self.v_cache, self.slots)

    def attend(self, out: torch.Tensor, canonical: bool | torch.Tensor, **kw: object) -> None:
        """Both schedules' call as the engine makes it: its own keys from the step's K/V."""
        paged_attention(
            self.q, self.k_cache, self.v_cache, self.table, self.seq_lens, self.query_start_loc,
            self.q.shape[2] ** -0.5, canonical=canonical, out=out, k=self.key, v=self.value, **kw,
        )  # fmt: skip

    def attend_canonical_gluon(self, out: torch.Tensor) -> None:
        """The canonical schedule on ``hopper_prefill``'s kernel, called directly: the engine's
        plan keeps canonical launches on the Triton kernel until their bits agree."""
        heads, kv_heads = self.q.shape[1], self.k_cache.shape[2]
        hopper_prefill.prefill_attention(
            self.q, self.key, self.value, self.k_cache, self.v_cache, self.table, self.seq_lens, self.query_start_loc,
            torch.ones_like(self.seq_lens), self.q.shape[2] ** -0.5, out,
            canonical=kernels.hopper_canonical(heads // kv_heads),
        )  # fmt: skip


def time_prefill(
    heads: int,
    kv_heads: int,
    head_dim: int,
    seqs: int,
    length: int,
    prefix: int,
    bandwidth: float,
    flops: float,
    device: torch.device,
    smoke: bool,
    canonical_gluon: bool = False,
) -> list[dict]:
    """``seqs`` prompt chunks of ``length`` tokens after ``prefix`` cached ones (K/V stored first,
    as the engine does): the store, then attention in both schedules, the chunks' own keys read
    from the step's K/V as the engine passes them."""
    elem = torch.finfo(DTYPE).bits // 8
    context = prefix + length
    cached = seqs * context
    step = Step.random(heads, kv_heads, head_dim, [context] * seqs, [length] * seqs, device)
    case = dict(kind="prefill", batch=seqs, context=length, prefix=prefix)
    rows = [
        dict(case, kind="store_kv", schedule="-", ms=bench(step.store, smoke), graph_ms=bench_graph(step.store, smoke),
             floor_ms=4 * step.key.numel() * elem / bandwidth * 1e3)
    ]
    out = torch.empty_like(step.q)
    flop = 4 * heads * head_dim * seqs * (length * prefix + length * (length + 1) // 2)
    floor_bytes = cached * 2 * kv_heads * head_dim * elem + 2 * step.q.numel() * elem
    # The Triton launches, and on sm_90 the Gluon ones beside them ("... gluon").
    schedules = [("fast", False, False), ("canonical", True, False)]
    if hopper_prefill.supports(step.q, step.k_cache):
        # A canonical kernel whose rows lack the Triton kernel's bits is not timed: on an H100
        # (2026-12-07) it faulted inside the timing and took the rest of the run with it.
        schedules += [("fast gluon", False, True)] + [("canonical gluon", True, True)] * canonical_gluon
    for schedule, canonical, gluon in schedules:
        def prefill() -> None:
            if canonical and gluon:
                step.attend_canonical_gluon(out)
            else:
                step.attend(out, canonical, max_query_len=length, max_seq_len=context)

        with hopper(gluon):
            ms = bench(prefill, smoke)
            graph_ms = bench_graph(prefill, smoke)
        rows.append(
            dict(case, schedule=schedule, ms=ms, graph_ms=graph_ms,
                 floor_ms=max(floor_bytes / bandwidth, flop / flops) * 1e3,
                 tflops=flop / ((graph_ms or ms) * 1e-3) / 1e12)
        )
    return rows


def time_mixed(
    heads: int,
    kv_heads: int,
    head_dim: int,
    decodes: int,
    decode_context: int,
    prompts: int,
    length: int,
    bandwidth: float,
    flops: float,
    device: torch.device,
    smoke: bool,
) -> list[dict]:
    """A prompt step as the engine forms one: ``decodes`` one-row sequences first, then
    ``prompts`` fresh prompts, their K/V already stored. Each schedule (and riding: the first
    prompt and every tenth decode canonical) with the decodes in a launch of their own
    (``num_decodes``, as the engine passes it) and in the prompt launch (schedule ``... 1L``)."""
    elem = torch.finfo(DTYPE).bits // 8
    seqs = decodes + prompts
    lens = [decode_context] * decodes + [length] * prompts
    step = Step.random(heads, kv_heads, head_dim, lens, [1] * decodes + [length] * prompts, device)
    step.store()
    out = torch.empty_like(step.q)
    riding = torch.zeros(seqs, dtype=torch.int32, device=device)
    riding[:decodes:RIDE_EVERY] = 1
    riding[decodes] = 1
    flop = 4 * heads * head_dim * (decodes * decode_context + prompts * length * (length + 1) // 2)
    floor_bytes = sum(lens) * 2 * kv_heads * head_dim * elem + 2 * step.q.numel() * elem
    case = dict(kind="mixed", batch=f"{decodes}+{prompts}", context=f"{decode_context}|{length}",
                floor_ms=max(floor_bytes / bandwidth, flop / flops) * 1e3)
    rows = []
    for schedule, canonical in (("fast", False), ("canonical", True), ("riding", riding)):
        for own in (True, False):
            def attend() -> None:
                step.attend(out, canonical, max_query_len=length, max_seq_len=max(lens),
                            schedules=(True, True) if schedule == "riding" else None, num_decodes=decodes if own else 0)

            rows.append(dict(case, schedule=schedule if own else f"{schedule} 1L", ms=bench(attend, smoke),
                             graph_ms=bench_graph(attend, smoke)))
    return rows


@contextmanager
def hopper(on: bool) -> Iterator[None]:
    """Prompt launches run as ``hopper_prefill``'s Gluon kernels where they can (``on``) or not."""
    kept = kernels.HOPPER_PREFILL
    kernels.HOPPER_PREFILL = on
    try:
        yield
    finally:
        kernels.HOPPER_PREFILL = kept


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(sorted(KINDS)), help="timed cases, of decode,prefill,mixed")
    parser.add_argument("--models", default=None, help="head shapes, of " + ",".join(FULL.models))
    opts = parse_args(parser)
    kinds = set(opts.kinds.split(","))
    if not kinds <= KINDS:
        parser.error(f"--kinds takes {sorted(KINDS)}, got {opts.kinds}")
    if opts.models and not set(opts.models.split(",")) <= set(FULL.models):
        parser.error(f"--models takes {sorted(FULL.models)}, got {opts.models}")
    sizes = SMOKE if opts.smoke else FULL
    if opts.smoke:
        CANONICAL_CONFIG.update(SMOKE_CONFIG)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    bandwidth = measure_bandwidth(sizes, device, opts.smoke)
    flops = measure_matmul(sizes, device, opts.smoke)
    result = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        canonical_config=CANONICAL_CONFIG,
        bandwidth_gbps=bandwidth / 1e9,
        matmul_tflops=flops / 1e12,
        checks={},
        timings={},
    )
    for name, (heads, kv_heads, head_dim) in sizes.models.items():
        if opts.models and not opts.smoke and name not in opts.models.split(","):
            continue
        check = result["checks"][name] = check_model(sizes, heads, kv_heads, head_dim, device)
        print(f"{name}: correctness {check}", flush=True)
        result["timings"][name] = time_model(sizes, heads, kv_heads, head_dim, bandwidth, flops, device, opts.smoke,
                                             kinds, check.get("canonical_gluon_rows_changed") == 0)
    path = write_json("attention", result, opts.out)

    print(f"\n{result['device']}: read bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print(
        f"{'model':<14}{'kind':<9}{'batch':>6}{'context':>12}{'schedule':>17}{'ms':>9}{'graph ms':>9}"
        f"{'floor ms':>9}{'floor/graph':>12}{'TFLOP/s':>8}{'graph@limit':>12}"
    )
    for name, rows in result["timings"].items():
        for r in rows:
            ratio = r["floor_ms"] / r["graph_ms"] if r["graph_ms"] else None
            context = f"{r['prefix']}+{r['context']}" if r.get("prefix") else str(r["context"])
            print(
                f"{name:<14}{r['kind']:<9}{r['batch']:>6}{context:>12}{r['schedule']:>17}{r['ms']:>9.4f}"
                f"{_fmt(r['graph_ms'], '.4f'):>9}{r['floor_ms']:>9.4f}{_fmt(ratio, '.2f'):>12}"
                f"{_fmt(r.get('tflops'), '.0f'):>8}{_fmt(r.get('limit_graph_ms'), '.4f'):>12}"
            )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
