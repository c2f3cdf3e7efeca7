"""CUDA graphs for decode steps of the fast lane, one per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps. Every bucket's graph reads the same static input buffers (a step's rows are
copied in, padded to the bucket with rows that write nothing) and all graphs share one
memory pool. Attention inside a graph is launched for ``max_seq_len`` keys (the model's
limit), so its schedule is fixed at capture; rows with shorter contexts skip the empty
tiles. Sampling stays outside the graph.
"""

from __future__ import annotations

import torch

from sid.model.decoder import CausalLM
from sid.runtime.attention import AttentionMetadata, PagedKVCache


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch``."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch + 1, 16)) + ([max_batch] if max_batch % 16 and max_batch > 8 else [])


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, kv_cache: PagedKVCache, *, max_batch: int, max_blocks: int, max_seq_len: int
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.max_seq_len = max_seq_len
        self.buckets = decode_buckets(max_batch)
        device = kv_cache.k[0].device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def forward(self, b: int) -> torch.Tensor:
        """The captured computation, eagerly: logits of the first ``b`` static rows."""
        self.kv_cache.meta = self._meta(b)
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self.forward(b)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self.forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def load(
        self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], seq_lens: list[int]
    ) -> int:
        """Copy a decode step's rows into the static buffers, padding to the bucket; returns it."""
        n = len(input_ids)
        b = self.bucket(n)
        assert b is not None
        width = self.block_tables.shape[1]
        dev = self.input_ids.device
        self.input_ids[:n].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.block_tables[:n].copy_(table.to(dev, non_blocking=True))
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        return b

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.logits[b]
