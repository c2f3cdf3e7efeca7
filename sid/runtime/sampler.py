"""Token sampling where every row is a pure function of its own logits, seed and position.

Random choices use the Gumbel-max trick with noise from a counter-based hash of
(seed, position, token id): no generator state is shared between rows, so a seeded
request draws the same token whatever batch it sits in and however often it is
recomputed (DESIGN 3.6). Greedy is the same path with no noise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser: a bijective 64-bit mix, wrapping int64 arithmetic."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``[R, V]`` determined by (seed, position, token id) alone."""
    key = _mix64(_mix64(seeds * _GOLDEN + positions) + _GOLDEN)
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix64(key[:, None] ^ (token[None, :] * _GOLDEN))
    u = (_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


@dataclass
class SamplingBatch:
    """Per-row sampling settings, on the logits' device."""

    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_k: torch.Tensor  # [R] int64; vocab size = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64: index of the token being chosen
    presence_penalty: torch.Tensor | None = None  # [R]
    frequency_penalty: torch.Tensor | None = None  # [R]
    repetition_penalty: torch.Tensor | None = None  # [R]
    output_counts: torch.Tensor | None = None  # [R, V] occurrences among generated tokens
    seen: torch.Tensor | None = None  # [R, V] bool: in prompt or output
    num_logprobs: int | None = None  # top-N to return; None = no row asked for logprobs
    any_random: bool = False
    any_top_k: bool = False
    any_top_p_or_min_p: bool = False

    def __getitem__(self, part: slice) -> SamplingBatch:
        """The settings of rows ``part``."""
        return replace(self, **{
            f.name: getattr(self, f.name)[part] for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        })


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    logprob: torch.Tensor | None = None  # [R] logprob of the chosen token
    rank: torch.Tensor | None = None  # [R]
    top_ids: torch.Tensor | None = None  # [R, K]
    top_logprobs: torch.Tensor | None = None  # [R, K]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """vLLM's repetition (prompt + output), frequency and presence (output) penalties."""
    if b.repetition_penalty is not None and b.seen is not None:
        rep = b.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(b.seen, penalised, logits)
    if b.output_counts is not None:
        counts = b.output_counts.to(logits.dtype)
        logits = logits - b.frequency_penalty[:, None] * counts
        logits = logits - b.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def _truncate_distribution(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Mask tokens outside top-k, top-p and min-p (each a function of the row alone)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.any_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        drop |= ranks[None, :] >= b.top_k[:, None]
    if b.any_top_p_or_min_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Rows with top_p = 1 must stay untouched even where rounding lifts the cumsum past 1,
        # or a row's tokens would depend on whether another row asked for top-p.
        drop |= ((probs.cumsum(dim=-1) - probs) > b.top_p[:, None]) & (b.top_p[:, None] < 1.0)
        drop |= probs < b.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


BLOCK_LOGITS = 1 << 25
"""Logits a block of rows holds at most: a row's choice and its logprobs take a dozen
temporaries of its size (the sort's indices, the noise's int64 hashes), so rows go through
them a block at a time. A canonical pass whose 32,768 rows each choose a token from
Llama-3's 128,256 asked for 31 GiB at once (H100, 2026-12-07); a block of 261 such rows
needs about 2 GiB by that count. Each row's result is its own (module doc), so blocks change
no bits."""


def _row_blocks(rows: int, vocab: int) -> list[slice]:
    """Rows of each block; none where one block holds them all (the common case, kept free of
    per-block slicing on the host)."""
    step = max(1, BLOCK_LOGITS // max(1, vocab))
    return [slice(i, i + step) for i in range(0, rows, step)] if rows > step else []


def _in_blocks(fn: Callable[..., SamplerOutput], logits: torch.Tensor, *per_row: Any) -> SamplerOutput:
    """``fn(logits, *per_row)`` a block of rows at a time, ``per_row`` sliced with the rows."""
    blocks = _row_blocks(*logits.shape)
    if not blocks:
        return fn(logits, *per_row)
    parts = [fn(logits[part], *(a[part] for a in per_row)) for part in blocks]
    return SamplerOutput(**{
        f.name: None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
        for f in fields(SamplerOutput)
    })


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """Choose one token per row of float32 ``logits`` ``[R, V]``."""
    return _in_blocks(_sample, logits, b)


def _sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    raw = logits
    logits = apply_penalties(logits, b)
    tokens = logits.argmax(dim=-1)
    if b.any_random:
        scaled = logits / torch.where(b.temperature > 0, b.temperature, 1.0)[:, None]
        if b.any_top_k or b.any_top_p_or_min_p:
            scaled = _truncate_distribution(scaled, b)
        noisy = scaled + gumbel_noise(b.seeds, b.positions, logits.shape[-1])
        tokens = torch.where(b.temperature > 0, noisy.argmax(dim=-1), tokens)
    if b.num_logprobs is None:
        return SamplerOutput(token_ids=tokens)
    return _logprobs(raw, tokens, b.num_logprobs)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    """Logprob and rank of ``token_ids`` under the raw ``logits``, plus the top ``num_top``."""
    return _in_blocks(functools.partial(_logprobs, num_top=num_top), logits, token_ids)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])
    out = SamplerOutput(token_ids=token_ids, logprob=chosen[:, 0], rank=(logprobs > chosen).sum(dim=-1) + 1)
    if num_top > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(num_top, dim=-1)
    return out
