"""Start-up self-test of the canonical numerics contract (DESIGN 3.7).

The same probe positions are computed in passes that differ in everything the contract
says must not matter: the slot a row sits in, the other rows of the pass, how the probe is
chunked across passes, the size of the pass and of its LM head, and whether its prefix came
from the prefix cache. Logits, K/V and tokens sampled at temperature > 0 must agree bit for
bit; otherwise deterministic mode refuses to start, naming what broke.

Where deterministic rows ride in ordinary passes (``ModelRunner.ride``), the probe is a
deterministic request among normal ones, which attend with the fast schedule, in passes of
several sizes (the GEMMs were proven at every size already, ``sid.runtime.gemm``). Where
they take the windowed canonical lane, the passes are canonical ones, at every ``PassSizes``
size the KV pool can fill: a size above ``M_canon`` that changes bits is dropped instead
(a warning says which), as is one the pool cannot fill. The probe is long enough for its
rows to cross the attention backend's canonical split boundaries (``probe_keys``), where
the model's length limit and the pool allow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import torch

from sid.engine.kv_cache import KVCacheManager, cdiv
from sid.engine.request import Request
from sid.engine.plan import PassSizes, ScheduledChunk
from sid.runtime.model_runner import ModelRunner
from sid.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=1)


def synthetic_request(
    request_id: str,
    tokens: list[int],
    prompt_len: int,
    domain: str,
    params: SamplingParams = _PARAMS,
    deterministic: bool = True,
) -> Request:
    """A request holding ``tokens``, the first ``prompt_len`` as its prompt: rows past the
    prompt's last choose a token, so a large pass computes their logits."""
    request = Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=tokens[:prompt_len],
        params=params,
        seed=params.seed or 0,
        max_tokens=len(tokens),
        eos_token_ids=frozenset(),
        arrival=0,
        deterministic=deterministic,
        domain=domain if deterministic else "fast",
    )
    request.token_ids.extend(tokens[prompt_len:])
    request.num_emitted = len(tokens) - prompt_len
    return request


class DeterminismSelfTestError(RuntimeError):
    """Canonical passes are not row-independent on this machine: no guarantee can be served."""


@dataclass
class ProbeRun:
    tokens: dict[int, int] = field(default_factory=dict)  # position -> token sampled from its logits
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    kv: list[torch.Tensor] = field(default_factory=list)  # per layer: [2, positions, kv_heads, head_dim]


class SelfTest:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, domain: str, max_model_len: int) -> None:
        self.runner, self.kv, self.domain = runner, kv, domain
        self.ride = runner.ride
        self.proven = runner.model.gemms.invariant is not None
        """The GEMMs were proven row-invariant at every pass size: passes of any size may be used."""
        self.m = runner.canonical.base
        bs = kv.block_size
        capacity = kv.pool.num_free * bs
        # Filler rows crowd the probe's passes, up to the largest pass size the pool allows,
        # in as many sequences as the model's length limit asks for. Riding rows' GEMMs were
        # proven at every size, so their passes are spot-checked up to a size that stays quick.
        largest = (
            min(runner.canonical.max, 1024 if runner.device.type == "cuda" else 256)
            if self.proven
            else runner.canonical.max
        )
        self.filler_rows = max(min(largest, capacity // 2), min(self.m, capacity // 3))
        gen = torch.Generator().manual_seed(0)
        filler = torch.randint(0, runner.vocab_size, (self.filler_rows,), generator=gen).tolist()
        self.fillers = [filler[i : i + max_model_len - 1] for i in range(0, self.filler_rows, max_model_len - 1)]
        probe = max(2 * max(self.m, 32) + 37, runner.kv_cache.backend.probe_keys)
        self.n = min(probe, max_model_len - 1, capacity - sum(cdiv(len(f), bs) * bs for f in self.fillers))
        if self.n < 2:
            raise DeterminismSelfTestError(
                f"the self-test needs a probe of 2 tokens or more: max_model_len={max_model_len} and a KV cache of "
                f"{capacity} token slots leave {max(self.n, 0)}; raise them (num_kv_blocks, cpu_kv_cache_bytes or "
                "gpu_memory_utilization), or pass enable_determinism=False"
            )
        self.probe = torch.randint(0, runner.vocab_size, (self.n,), generator=gen).tolist()
        self._ids = count()

    @property
    def sizes(self) -> list[int]:
        """The pass sizes above ``M_canon`` that the filler can fill: all of them, or a few
        spread ones where the GEMMs were proven at every size already."""
        sizes = [s for s in self.runner.canonical.sizes[1:] if s <= self.filler_rows]
        if self.proven and sizes:
            return sorted({min(sizes, key=lambda s: abs(s - target)) for target in (self.n, 200, 1000, sizes[-1])})
        return sizes

    def request(self, tokens: list[int], prompt_len: int, deterministic: bool = True) -> Request:
        return synthetic_request(
            f"selftest-{next(self._ids)}", tokens, prompt_len, self.domain, deterministic=deterministic
        )

    def probe_request(self) -> Request:
        return self.request(self.probe, 1)

    def run(
        self, target: Request, start: int, stop: int, size: int, rows: Callable[[int], int], fill: Callable[[int], int]
    ) -> ProbeRun:
        """Positions ``start .. stop - 1`` of ``target`` in passes of at most ``size`` rows:
        ``fill(i)`` rows of the filler prompts (rows that choose no token, but for a filler
        sequence's last), then ``rows(i)`` probe rows. ``target`` must hold its blocks already."""
        kv = self.kv
        # Riding rows share passes with normal requests' rows; canonical passes hold canonical rows only.
        others = [self.request(f, len(f), deterministic=not self.ride) for f in self.fillers]
        if not all(kv.allocate(other, other.num_tokens) for other in others):
            raise DeterminismSelfTestError("the KV cache is too small for the self-test")
        out = ProbeRun()
        pos, used, i = start, 0, 0
        while pos < stop:
            f = max(0, min(fill(i), size - 1, self.filler_rows - 1))
            if used + f >= self.filler_rows:
                used = 0  # start the filler over: its rows compute the same K/V again
            chunks = _filler_chunks(others, used, f)
            used += f
            k = min(rows(i), stop - pos, size - f)
            chunks.append(ScheduledChunk(target, pos, k))
            table = kv.block_table([c.request for c in chunks])
            res = self.runner.execute(chunks, table, canonical=not self.ride, keep_logits=True)[-1]
            assert res.logits is not None
            for j, sampled in enumerate(res.samples):
                out.tokens[sampled.position] = sampled.token_id
                out.logits[sampled.position] = res.logits[j]
            pos, i = pos + k, i + 1
        device = self.runner.device
        ids = torch.tensor(kv.block_ids(target), dtype=torch.int64, device=device)
        p = torch.arange(stop, device=device)
        slots = ids[p // kv.block_size] * kv.block_size + p % kv.block_size
        cache = self.runner.kv_cache
        out.kv = [torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]]).cpu() for k, v in zip(cache.k, cache.v)]
        for other in others:
            kv.free(other)
        return out

    def fresh(self, size: int, rows: Callable[[int], int], fill: Callable[[int], int]) -> ProbeRun:
        target = self.probe_request()
        if not self.kv.allocate(target, self.n):
            raise DeterminismSelfTestError("the KV cache is too small for the self-test")
        out = self.run(target, 0, self.n, size, rows, fill)
        self.kv.free(target)
        return out

    def on_cached_prefix(self) -> tuple[ProbeRun, int]:
        """Compute the probe's first half, then the rest on top of its cached blocks."""
        kv, bs, m = self.kv, self.kv.block_size, max(self.m, 8)
        half = (self.n // 2 // bs) * bs
        first = self.probe_request()
        assert kv.allocate(first, half)
        self.run(first, 0, half, m, lambda i: m, lambda i: 0)
        first.n_canon = first.num_computed_tokens = half
        kv.cache_full_blocks(first, half)
        second = self.probe_request()
        cached = kv.find_cached_prefix(second)
        kv.free(first)
        if len(cached) * bs != half:
            raise DeterminismSelfTestError(f"the prefix cache returned {len(cached)} blocks for a {half}-token prefix")
        assert kv.allocate(second, self.n, cached)
        out = self.run(second, half, self.n, m, lambda i: m - 2, lambda i: 2)
        kv.free(second)
        return out, half


def self_test(runner: ModelRunner, kv: KVCacheManager, domain: str, max_model_len: int) -> PassSizes:
    """Raise ``DeterminismSelfTestError`` unless deterministic rows are independent of their
    company (at ``M_canon``, or at every size where the GEMMs were proven); returns the pass
    sizes that give a row the same bits (without a proof, a size that changes bits costs
    speed, not the guarantee)."""
    test = SelfTest(runner, kv, domain, max_model_len)
    m = test.m
    if test.proven:  # alone: lone rows (decode steps) first and last, chunks between; then crowded, at any size
        chunk = min(16, runner.canonical.max)
        singles = 8 + (test.n - 16) // chunk  # the pass from which the last 8 or more rows go alone
        alone = test.fresh(chunk, lambda i: 1 if i < 8 or i >= singles else chunk, lambda i: 0)
        crowded = test.fresh(
            min(64, runner.canonical.max), lambda i: (7, 13, 29, 5)[i % 4], lambda i: (3, 30, 1, 17)[i % 4]
        )
    else:
        alone = test.fresh(m, lambda i: m, lambda i: 0)
        crowded = test.fresh(m, lambda i: (7, 13, 29, 5)[i % 4], lambda i: (3, 11, 1, 6)[i % 4])
    _require(alone, crowded, range(test.n), "other rows in the pass, other slots and other chunking")
    if kv.enable_prefix_caching and test.n >= 2 * kv.block_size:
        cached, start = test.on_cached_prefix()
        _require(alone, cached, range(start, test.n), "its prefix taken from the prefix cache")
    # Two passes per size, the first filled to ``size`` rows with filler, the second to one
    # row less (padded); only their probe rows choose tokens, so the LM head runs on fewer
    # rows, at a size of its own.
    half = cdiv(test.n, 2)
    passed = [m]
    for size in test.sizes:
        sized = test.fresh(size, lambda i: half, lambda i, size=size: size - half - i)
        if test.proven:
            _require(alone, sized, range(test.n), f"a pass of {runner.canonical.fit(size)} rows")
            continue
        broken = _difference(alone, sized, range(test.n))
        if broken is None:
            passed.append(size)
        else:
            logger.warning("canonical passes of %d rows are not used: %s in a pass of that size", size, broken)
    return runner.canonical if test.proven else PassSizes(tuple(passed))


def _filler_chunks(others: list[Request], start: int, rows: int) -> list[ScheduledChunk]:
    """Rows ``start .. start + rows - 1`` of the filler, which ``others`` hold in order."""
    chunks, offset = [], 0
    for other in others:
        lo, hi = max(start - offset, 0), min(start + rows - offset, other.num_tokens)
        if lo < hi:
            chunks.append(ScheduledChunk(other, lo, hi - lo))
        offset += other.num_tokens
    return chunks


def _require(ref: ProbeRun, other: ProbeRun, positions: range, what: str) -> None:
    broken = _difference(ref, other, positions)
    if broken is not None:
        raise DeterminismSelfTestError(
            f"deterministic mode refused: {broken} with {what}; canonical rows are not independent on this machine"
        )



def _difference(ref: ProbeRun, other: ProbeRun, positions: range) -> str | None:
    """The first of logits, sampled tokens and K/V whose bits differ between two probe runs."""
    for p in positions:
        if not torch.equal(ref.logits[p], other.logits[p]):
            delta = (ref.logits[p] - other.logits[p]).abs().max().item()
            return f"canonical logits at probe position {p} change (max |delta| {delta:.3g})"
        if ref.tokens[p] != other.tokens[p]:
            return f"the token sampled at position {p} changes"
    for layer, (x, y) in enumerate(zip(ref.kv, other.kv)):
        if not torch.equal(x[:, positions.start :], y[:, positions.start :]):
            return f"canonical K/V of layer {layer} changes"
    return None
