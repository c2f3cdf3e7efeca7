"""How many KV blocks an engine gets (vLLM's memory profiling).

On a GPU the pool is the engine's share of the device (``gpu_memory_utilization`` of its
memory) after its own weights and the peak activations of the largest step the scheduler
can plan, measured by running that step once with a throwaway cache, within what is free:
memory other engines of the process hold counts against the free part only. On a CPU it is
what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, within ``cpu_kv_cache_bytes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from sid.engine.kv_cache import cdiv
from sid.engine.request import Request
from sid.engine.plan import ScheduledChunk
from sid.runtime.attention import PagedKVCache
from sid.runtime.model_runner import ModelRunner
from sid.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sid.engine.engine import LLMEngine


def block_bytes(engine: LLMEngine) -> int:
    """Bytes of one KV block on this rank (every layer, K and V)."""
    cfg = engine.model_config
    return PagedKVCache.bytes_per_block(
        cfg.num_layers, engine.config.block_size, engine.model.shard.num_kv_heads, cfg.head_dim, engine.dtype
    )


def num_kv_blocks(engine: LLMEngine, baseline: int) -> int:
    """The pool's size; ``baseline``: bytes other engines held on the device when this one started."""
    config, device = engine.config, engine.device
    per_block = block_bytes(engine)
    if device.type != "cuda":
        wanted = cdiv(config.max_num_seqs * engine.max_model_len, config.block_size)
        return max(1, min(wanted, config.cpu_kv_cache_bytes // per_block))
    own_peak = _profile_peak_bytes(engine) - baseline
    own_now = torch.cuda.memory_allocated(device) - baseline
    free, total = torch.cuda.mem_get_info(device)
    share = int(total * config.gpu_memory_utilization)
    budget = min(share - own_peak, free - (own_peak - own_now))
    if budget < per_block:
        raise ValueError(
            f"no memory left for the KV cache: weights and activations take {own_peak / 2**30:.1f} GiB of "
            f"this engine's {share / 2**30:.1f} GiB, with {free / 2**30:.1f} GiB free on the device; "
            "raise gpu_memory_utilization or free the GPU"
        )
    return budget // per_block


def _profile_peak_bytes(engine: LLMEngine) -> int:
    """Peak memory of the largest step the scheduler can plan, with a throwaway cache."""
    config, device = engine.config, engine.device
    bs = config.block_size
    tokens = config.max_num_batched_tokens
    seq_len = min(tokens, engine.max_model_len)
    num_seqs = cdiv(tokens, seq_len)
    profile_cache = engine.kv_cache_of(num_seqs * cdiv(seq_len, bs))
    runner = ModelRunner(engine.model, profile_cache, bs, device, engine.canonical, engine.workers)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, logprobs=5)
    chunks = []
    for s in range(num_seqs):
        n = min(seq_len, tokens - s * seq_len)
        r = Request(f"profile-{s}", None, [0] * n, params, 0, 1, frozenset(), 0)
        chunks.append(ScheduledChunk(r, 0, n))
    width = cdiv(seq_len, bs)
    tables = np.arange(num_seqs * width, dtype=np.int32).reshape(num_seqs, width)  # the whole throwaway cache
    runner.execute(chunks, tables)
    if config.enable_determinism:
        # The largest canonical pass with every row choosing a token: its LM head and
        # sampler take more memory than the fast step's few sampled rows.
        rows = min(engine.canonical.max, width * bs)
        r = Request("profile-canonical", None, [0], params, 0, rows, frozenset(), 0)
        r.token_ids.extend([0] * (rows - 1))
        r.num_emitted = rows - 1
        runner.execute([ScheduledChunk(r, 0, rows)], tables[:1], canonical=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(
        t.numel() * t.element_size() for t in profile_cache.k + profile_cache.v
    )
    del profile_cache, runner
    torch.cuda.empty_cache()
    return peak
