"""Start-up timing of forward passes, for the scheduler's cost model (``MeasuredPassCost``).

What a pass costs depends on the model and the machine. A small model's eager pass is bound
by launching its few hundred kernels from the host, which a CUDA graph avoids: on an H200 a
Qwen3-0.6B-shaped model's eager canonical pass of ~300 rows took 21-24 ms inside a step
where its graphed decode steps of 256 rows took 7. A large model's pass is bound by reading
its weights and, past a few hundred rows, by its GEMMs. So instead of a formula the engine
times a few passes of each kind once its graphs are captured and the self-test has passed,
as the scheduler will run them: decode rows (one per request) for graphed passes, fresh
prompt chunks for eager ones.

Two things make a timing match a step of a running engine. Decode rows read a mid-length
context (the engine asks for 1,024 keys), since attention is a share of a long-context step
that both lanes pay, and at position 0 an extra or padded pass's fixed costs looked larger
than they are. And passes are queued back to back, as the engine's overlapped scheduling
queues its steps: the host prepares the next pass while the GPU runs one, so a pass costs
the larger of its host and GPU time rather than their sum (a lone pass, waited for, is
timed too: queueing can only help, and on the H200 a first queued run of a launch-bound
pass sometimes took twice as long). Each point is the best of a few runs (the host's noise
only adds time); it takes a few seconds.
"""

from __future__ import annotations

import logging
import time
from itertools import count
from typing import TYPE_CHECKING

import numpy as np
import torch

from sid.engine.kv_cache import KVCacheManager, cdiv
from sid.engine.plan import PassSizes, ScheduledChunk
from sid.engine.selftest import self_test, synthetic_request
from sid.engine.windowed import GPU_COST, MeasuredPassCost, WindowedLane
from sid.runtime.model_runner import ModelRunner
from sid.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sid.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

_PROMPT_ROWS = (16, 256, 1024)
"""Eager passes are timed at these prompt sizes and at the largest pass."""
_GREEDY = SamplingParams(temperature=0.0)
"""Timed passes choose their tokens greedily: a top-p sort over the vocabulary for every
row would cost more than a small model's whole pass and drown the difference between passes."""


def calibrate(engine: LLMEngine, windowed: WindowedLane) -> None:
    """The last of start-up, on the built engine: with determinism, the self-test (which
    fixes the canonical pass sizes) and, for a GPU's windowed lane, the passes its scheduler
    weighs; on a GPU the prompt shapes' kernels compile before any request meets them."""
    config, runner, kv, domain = engine.config, engine.runner, engine.kv, engine.canonical_domain
    cuda = engine.device.type == "cuda"
    chunk_len = min(1024, engine.max_model_len - 1)
    timed = cuda and config.enable_determinism and not engine.ride
    if config.enable_determinism:
        engine.canonical = self_test(runner, kv, domain, engine.max_model_len)
        windowed.canonical = runner.canonical = engine.canonical
        windowed.graph_rows = max((s for s in engine.canonical.sizes if runner.graphed(s)), default=0)
        windowed.fast_graph_rows = runner.graphs.buckets[-1] if runner.graphs is not None else 0
        if timed:
            measured = measure_pass_costs(
                runner,
                kv,
                domain,
                fast_graph_rows=windowed.fast_graph_rows,
                graph_rows=windowed.graph_rows,
                max_rows=config.max_num_batched_tokens,
                chunk_len=chunk_len,
                context=min(1024, engine.max_model_len // 2),
                launches=4 if engine.async_scheduling else 1,  # lockstep: a pass's host and GPU time add up
            )
            windowed.cost_model = measured or GPU_COST
    if cuda and not timed:  # timing the passes compiled their kernels
        warm_up(runner, kv, domain, max_rows=config.max_num_batched_tokens, chunk_len=chunk_len)


def measure_pass_costs(
    runner: ModelRunner,
    kv: KVCacheManager,
    domain: str,
    *,
    fast_graph_rows: int,
    graph_rows: int,
    max_rows: int,
    chunk_len: int,
    context: int,
    repeats: int = 3,
    launches: int = 4,
) -> MeasuredPassCost | None:
    """Time the passes the scheduler weighs against each other: fast decode steps up to
    ``fast_graph_rows`` (graphed), fast prompt passes up to ``max_rows`` (eager), canonical
    passes up to ``graph_rows`` (graphed) and above (eager), prompts in chunks of at most
    ``chunk_len`` tokens. Decode rows read ``context`` keys each (fewer when the KV pool
    cannot hold that many); each timing is the best of a lone pass, waited for, and of
    ``launches`` passes queued back to back. None when the pool cannot hold one table's
    passes at once."""
    sizes: PassSizes = runner.canonical
    graphed = _spread([s for s in sizes.sizes if s <= graph_rows])
    eager = _spread([s for s in sizes.sizes if s > graph_rows])
    prompt = sorted({min(r, max_rows) for r in (*_PROMPT_ROWS, max_rows)})
    decode = sorted({r for r in (1, 16, 64, fast_graph_rows // 2, fast_graph_rows) if 1 <= r <= fast_graph_rows})
    decode_rows = max(sum(decode), sum(graphed))  # a block each at least
    needed = max(decode_rows, *(sum(cdiv(r, kv.block_size) + cdiv(r, chunk_len) for r in t) for t in (prompt, eager)))
    if needed > kv.pool.num_free:
        return None
    while context and decode_rows * cdiv(context + 1, kv.block_size) > kv.pool.num_free:
        context //= 2
    timer = _PassTimer(runner, kv, domain, chunk_len, context, repeats, launches)
    cost = MeasuredPassCost(
        fast_graphed=timer.table(decode, decode=True, canonical=False),
        fast_eager=timer.table(prompt, decode=False, canonical=False),
        canonical_graphed=timer.table(graphed, decode=True, canonical=True),
        canonical_eager=timer.table(eager, decode=False, canonical=True),
    )
    logger.info("pass costs (rows, ms; decode rows at %d keys): %s", context, cost)
    return cost


def warm_up(runner: ModelRunner, kv: KVCacheManager, domain: str, *, max_rows: int, chunk_len: int) -> None:
    """Run fast prompt passes of a few sizes once, where no pass timing does it (deterministic
    rows that ride, or determinism off): Triton compiles a kernel the first time it meets a
    block shape, about a second each, and one compiled in a running engine stalls every
    request's step (on the H200: 2.8 s of a Qwen3-0.6B benchmark's first two rounds, with
    their throughput 25 % down). Decode shapes compile when the graphs are captured."""
    timer = _PassTimer(runner, kv, domain, chunk_len, context=0, repeats=0, launches=1)
    prompt = sorted({min(r, max_rows) for r in (*_PROMPT_ROWS, max_rows)})
    if sum(cdiv(r, kv.block_size) + cdiv(r, chunk_len) for r in prompt) <= kv.pool.num_free:
        timer.table(prompt, decode=False, canonical=False)


def _spread(sizes: list[int]) -> list[int]:
    """The first, last, and the size nearest 1,024 rows between them."""
    if len(sizes) <= 2:
        return sizes
    return sorted({sizes[0], min(sizes, key=lambda s: abs(s - 1024)), sizes[-1]})


class _PassTimer:
    def __init__(
        self, runner: ModelRunner, kv: KVCacheManager, domain: str, chunk_len: int, context: int, repeats: int,
        launches: int
    ) -> None:
        self.runner, self.kv, self.domain = runner, kv, domain
        self.chunk_len, self.context, self.repeats, self.launches = chunk_len, context, repeats, launches
        self._ids = count()
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, runner.vocab_size, (max(chunk_len, context + 1),), generator=gen).tolist()

    def _chunks(self, rows: int, decode: bool) -> list[ScheduledChunk]:
        """``rows`` decode rows (one per request, each after ``context`` prompt tokens), or
        prompts of ``chunk_len`` tokens (the last shorter) holding ``rows`` rows in all."""
        if decode:
            lengths = [self.context + 1] * rows
        else:
            lengths = [min(self.chunk_len, rows - i) for i in range(0, rows, self.chunk_len)]
        chunks = []
        for n in lengths:
            request = synthetic_request(f"calibrate-{next(self._ids)}", self.tokens[:n], n, self.domain, _GREEDY)
            if not self.kv.allocate(request, n):
                raise RuntimeError("the KV pool ran out while timing passes")
            chunks.append(ScheduledChunk(request, n - 1, 1) if decode else ScheduledChunk(request, 0, n))
        return chunks

    def table(self, sizes: list[int], *, decode: bool, canonical: bool) -> tuple[tuple[int, float], ...]:
        """Best milliseconds per pass of each size, from launch to its results: of one pass
        waited for, and of ``launches`` passes queued back to back as the engine queues its
        steps (the host prepares the next pass while the GPU runs one, so a queued pass
        costs at most what a lone one does). The sizes take turns, so a slow stretch of the
        host's does not fall on every run of one size."""
        sets = [self._chunks(rows, decode) for rows in sizes]
        tables = [self.kv.block_table([c.request for c in chunks]) for chunks in sets]
        for chunks, table in zip(sets, tables):
            self.runner.execute(chunks, table, canonical=canonical)  # warms the allocator and kernels
        best = [float("inf")] * len(sizes)
        for _ in range(self.repeats):
            for i, (chunks, table) in enumerate(zip(sets, tables)):
                for launches in {1, self.launches}:
                    best[i] = min(best[i], self._timed(chunks, table, canonical, launches))
        for chunks in sets:
            for chunk in chunks:
                self.kv.free(chunk.request)
        return tuple(zip(sizes, best))

    def _timed(self, chunks: list[ScheduledChunk], table: np.ndarray, canonical: bool, launches: int) -> float:
        """Milliseconds per pass of ``launches`` passes queued back to back."""
        runner = self.runner
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        for launched in [runner.launch(chunks, table, canonical=canonical) for _ in range(launches)]:
            runner.collect(launched)
        if cuda:
            torch.cuda.synchronize(runner.device)
        return (time.perf_counter() - start) / launches * 1e3
