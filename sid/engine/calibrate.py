"""Start-up timing of forward passes, for the scheduler's cost model (``MeasuredPassCost``).

What a pass costs depends on the model and the machine. A small model's eager pass is bound
by launching its few hundred kernels from the host, which a CUDA graph avoids: on an H200 a
Qwen3-0.6B-shaped model's eager canonical pass of ~300 rows took 21-24 ms inside a step
where its graphed decode steps of 256 rows took 7. A large model's pass is bound by reading
its weights and, past a few hundred rows, by its GEMMs. So instead of a formula the engine
times a few passes of each kind once its graphs are captured and the self-test has passed,
as the scheduler will run them: decode rows (one per request) for graphed passes, fresh
prompt chunks for eager ones. Each point is the best of a few runs (the host's noise only
adds time); it takes about a second. Decode rows sit at position 0, so their attention is
left out: at a given context it costs both lanes about the same, but it makes a long-context
step's fixed costs (an extra pass, a padded canonical one) look larger than they are.
"""

from __future__ import annotations

import logging
import time
from itertools import count

import torch

from sid.engine.kv_cache import KVCacheManager, cdiv
from sid.engine.request import Request
from sid.engine.scheduler import MeasuredPassCost, PassSizes, ScheduledChunk
from sid.engine.selftest import synthetic_request
from sid.runtime.model_runner import ModelRunner
from sid.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PROMPT_ROWS = (16, 256, 1024)
"""Eager passes are timed at these prompt sizes and at the largest pass."""
_GREEDY = SamplingParams(temperature=0.0)
"""Timed passes choose their tokens greedily: a top-p sort over the vocabulary for every
row would cost more than a small model's whole pass and drown the difference between passes."""


def measure_pass_costs(
    runner: ModelRunner,
    kv: KVCacheManager,
    domain: str,
    *,
    fast_graph_rows: int,
    graph_rows: int,
    max_rows: int,
    chunk_len: int,
    repeats: int = 3,
) -> MeasuredPassCost | None:
    """Time the passes the scheduler weighs against each other: fast decode steps up to
    ``fast_graph_rows`` (graphed), fast prompt passes up to ``max_rows`` (eager), canonical
    passes up to ``graph_rows`` (graphed) and above (eager), prompts in chunks of at most
    ``chunk_len`` tokens. None when the KV pool cannot hold the largest of them."""
    sizes: PassSizes = runner.canonical
    graphed = [s for s in sizes.sizes if s <= graph_rows]
    eager = [s for s in sizes.sizes if s > graph_rows]
    prompt = sorted({min(r, max_rows) for r in (*_PROMPT_ROWS, max_rows)})
    decode = sorted({r for r in (1, 16, 64, fast_graph_rows // 2, fast_graph_rows) if 1 <= r <= fast_graph_rows})
    largest = max(max_rows, sizes.max)
    needed = max(max(decode, default=0), max(graphed, default=0), cdiv(largest, kv.block_size) + cdiv(largest, chunk_len))
    if needed > kv.pool.num_free:
        return None
    timer = _PassTimer(runner, kv, domain, chunk_len, repeats)
    cost = MeasuredPassCost(
        fast_graphed=tuple((r, timer.time(r, decode=True, canonical=False)) for r in decode),
        fast_eager=tuple((r, timer.time(r, decode=False, canonical=False)) for r in prompt),
        canonical_graphed=tuple((s, timer.time(s, decode=True, canonical=True)) for s in _spread(graphed)),
        canonical_eager=tuple((s, timer.time(s, decode=False, canonical=True)) for s in _spread(eager)),
    )
    logger.info("pass costs (rows, ms): %s", cost)
    return cost


def _spread(sizes: list[int]) -> list[int]:
    """The first, last, and the size nearest 1,024 rows between them."""
    if len(sizes) <= 2:
        return sizes
    return sorted({sizes[0], min(sizes, key=lambda s: abs(s - 1024)), sizes[-1]})


class _PassTimer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, domain: str, chunk_len: int, repeats: int) -> None:
        self.runner, self.kv, self.domain = runner, kv, domain
        self.chunk_len, self.repeats = chunk_len, repeats
        self._ids = count()
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, runner.vocab_size, (chunk_len,), generator=gen).tolist()

    def _requests(self, rows: int, decode: bool) -> list[Request]:
        """``rows`` one-token prompts (decode rows: one row per request), or prompts of
        ``chunk_len`` tokens (the last shorter) holding ``rows`` rows in all."""
        lengths = [1] * rows if decode else [min(self.chunk_len, rows - i) for i in range(0, rows, self.chunk_len)]
        return [
            synthetic_request(f"calibrate-{next(self._ids)}", self.tokens[:n], n, self.domain, _GREEDY) for n in lengths
        ]

    def time(self, rows: int, *, decode: bool, canonical: bool) -> float:
        """Best wall milliseconds of a pass of ``rows`` rows, from launch to its results."""
        requests = self._requests(rows, decode)
        for request in requests:
            if not self.kv.allocate(request, request.num_tokens):
                raise RuntimeError("the KV pool ran out while timing passes")
        chunks = [ScheduledChunk(r, 0, r.num_tokens) for r in requests]
        blocks = [self.kv.block_ids(r) for r in requests]
        cuda = self.runner.device.type == "cuda"
        best = float("inf")
        for i in range(self.repeats + 1):  # the first run warms the allocator and kernels
            if cuda:
                torch.cuda.synchronize(self.runner.device)
            start = time.perf_counter()
            self.runner.execute(chunks, blocks, canonical=canonical)
            if cuda:
                torch.cuda.synchronize(self.runner.device)
            if i:
                best = min(best, time.perf_counter() - start)
        for request in requests:
            self.kv.free(request)
        return best * 1e3
