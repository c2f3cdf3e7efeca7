"""Turns a scheduled step into tensors, runs the model, and samples.

Input: the chunks the scheduler planned and the block ids each request holds. Output:
per chunk, the sampled token (when the chunk reached the end of its request), its
logprobs, and the prompt logprobs the chunk's rows produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sid.engine.request import Request
from sid.engine.scheduler import ScheduledChunk
from sid.model.decoder import CausalLM
from sid.outputs import Logprob, PositionLogprobs
from sid.runtime.attention import AttentionMetadata, PagedKVCache
from sid.runtime.sampler import SamplerOutput, SamplingBatch, compute_logprobs, sample


@dataclass
class ChunkResult:
    token_id: int | None = None
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)


def _position_logprobs(out: SamplerOutput, row: int) -> PositionLogprobs:
    """One row of a ``SamplerOutput`` on the host, as vLLM's ``{token_id: Logprob}``."""
    assert out.logprob is not None and out.rank is not None
    entry = {int(out.token_ids[row]): Logprob(float(out.logprob[row]), int(out.rank[row]))}
    if out.top_ids is not None and out.top_logprobs is not None:
        for rank, (tok, lp) in enumerate(zip(out.top_ids[row].tolist(), out.top_logprobs[row].tolist()), start=1):
            entry.setdefault(tok, Logprob(lp, rank))
    return entry


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.cfg.vocab_size

    def _tensor(self, data: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _metadata(self, chunks: Sequence[ScheduledChunk], block_ids: Sequence[Sequence[int]]) -> AttentionMetadata:
        bs = self.block_size
        slots: list[int] = []
        for chunk, blocks in zip(chunks, block_ids):
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
        width = max(len(b) for b in block_ids)
        tables = [list(b) + [0] * (width - len(b)) for b in block_ids]
        qsl = [0]
        for chunk in chunks:
            qsl.append(qsl[-1] + chunk.num_tokens)
        return AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor([c.end for c in chunks], torch.int32),
            query_start_loc=self._tensor(qsl, torch.int32),
            max_query_len=max(c.num_tokens for c in chunks),
            max_seq_len=max(c.end for c in chunks),
        )

    def _sampling_batch(self, requests: Sequence[Request]) -> SamplingBatch:
        params = [r.params for r in requests]
        v = self.vocab_size
        f32, i64 = torch.float32, torch.int64
        b = SamplingBatch(
            temperature=self._tensor([p.temperature for p in params], f32),
            top_k=self._tensor([p.top_k if p.top_k > 0 else v for p in params], i64),
            top_p=self._tensor([p.top_p for p in params], f32),
            min_p=self._tensor([p.min_p for p in params], f32),
            seeds=self._tensor([r.seed for r in requests], i64),
            positions=self._tensor([r.num_tokens for r in requests], i64),
            any_random=any(not p.greedy for p in params),
            any_top_k=any(0 < p.top_k < v for p in params),
            any_top_p_or_min_p=any(p.top_p < 1.0 or p.min_p > 0.0 for p in params),
        )
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            b.num_logprobs = max(wanted)
        if any(p.uses_penalties for p in params):
            b.presence_penalty = self._tensor([p.presence_penalty for p in params], f32)
            b.frequency_penalty = self._tensor([p.frequency_penalty for p in params], f32)
            b.repetition_penalty = self._tensor([p.repetition_penalty for p in params], f32)
            counts = torch.zeros((len(requests), v), dtype=i64, device=self.device)
            seen = torch.zeros((len(requests), v), dtype=torch.bool, device=self.device)
            for i, r in enumerate(requests):
                if r.params.uses_penalties:
                    out_ids = self._tensor(r.output_token_ids, i64)
                    counts[i].scatter_add_(0, out_ids, torch.ones_like(out_ids))
                    seen[i, self._tensor(r.token_ids, i64)] = True
            b.output_counts, b.seen = counts, seen
        return b

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], block_ids: Sequence[Sequence[int]]) -> list[ChunkResult]:
        """Run one forward pass over ``chunks`` and return a result per chunk."""
        input_ids: list[int] = []
        positions: list[int] = []
        prompt_rows: list[int] = []  # rows whose logits score the next prompt token
        prompt_targets: list[int] = []
        prompt_owner: list[int] = []
        sample_rows: list[int] = []
        sample_owner: list[int] = []
        for i, chunk in enumerate(chunks):
            r = chunk.request
            row0 = len(input_ids)
            input_ids.extend(r.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            if r.wants_prompt_logprobs:
                first = max(chunk.start, len(r.prompt_logprobs or ()) - 1)
                for p in range(first, min(chunk.end, r.num_prompt_tokens - 1)):
                    prompt_rows.append(row0 + p - chunk.start)
                    prompt_targets.append(r.token_ids[p + 1])
                    prompt_owner.append(i)
            if chunk.samples and r.num_output_tokens < r.max_tokens:
                sample_rows.append(row0 + chunk.num_tokens - 1)
                sample_owner.append(i)

        self.kv_cache.meta = self._metadata(chunks, block_ids)
        hidden = self.model(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), self.kv_cache)
        results = [ChunkResult() for _ in chunks]
        if prompt_rows:
            logits = self.model.compute_logits(hidden[self._tensor(prompt_rows, torch.int64)])
            num_top = max(chunks[i].request.params.prompt_logprobs or 0 for i in set(prompt_owner))
            scored = compute_logprobs(logits, self._tensor(prompt_targets, torch.int64), num_top)
            for row, owner in enumerate(prompt_owner):
                results[owner].prompt_logprobs.append(_trim(_position_logprobs(scored, row), chunks[owner].request.params.prompt_logprobs))
        if sample_rows:
            logits = self.model.compute_logits(hidden[self._tensor(sample_rows, torch.int64)])
            requests = [chunks[i].request for i in sample_owner]
            sampled = sample(logits, self._sampling_batch(requests))
            tokens = sampled.token_ids.tolist()
            for row, (owner, request) in enumerate(zip(sample_owner, requests)):
                results[owner].token_id = tokens[row]
                if request.params.logprobs is not None:
                    results[owner].logprobs = _trim(_position_logprobs(sampled, row), request.params.logprobs)
        return results


def _trim(entry: PositionLogprobs, num_top: int | None) -> PositionLogprobs:
    """Keep the chosen token (first) and this request's own top-N (the batch may ask for more)."""
    items = list(entry.items())
    keep = dict(items[:1])
    keep.update((tok, lp) for tok, lp in items[1:] if lp.rank <= (num_top or 0))
    return keep
