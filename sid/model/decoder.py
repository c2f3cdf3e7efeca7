"""One decoder for Llama, Mistral, Qwen2 and Qwen3, with config switches.

The model works on a flat batch of token rows (``[N]`` ids and positions). Attention goes
through a callable supplied per step by the runtime, which owns the paged KV cache; the
model itself holds no per-request state.

Under tensor parallelism each rank builds the same modules at its ``Shard``'s sizes
(Megatron-style): merged qkv and gate_up are split by output columns (whole heads),
o_proj and down_proj by input rows and summed across ranks, and the embedding and LM
head by vocabulary rows. Without a group (``tp=None``) no collective runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from sid.model.config import HeadLayout, ModelConfig
from sid.model.layers import QKRope, RMSNorm, RotaryEmbedding, silu_and_mul
from sid.runtime.gemm import Gemms, Linear


class PagedAttention(Protocol):
    """Applies a layer's ``QKRope`` to its queries and keys, writes its new K/V into the paged
    cache, then attends from the cache."""

    @property
    def canonical(self) -> bool:
        """The pass is canonical: cross-rank sums must use the fixed order (DESIGN 3.1)."""
        ...

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: QKRope) -> torch.Tensor: ...


class TensorParallel(Protocol):
    """The collectives a sharded model needs (``sid.runtime.distributed.TPGroup``)."""

    rank: int
    size: int

    def all_reduce_sum(self, x: torch.Tensor, canonical: bool) -> torch.Tensor: ...

    def all_reduce_tree(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard(HeadLayout):
    """One rank's slice of the model: its query heads, KV heads, MLP columns, vocabulary rows.

    KV heads are split when the TP size divides their count, and replicated (each rank
    keeps the one head its query heads read) when their count divides the TP size. The
    vocabulary is split in equal parts; the last rank's part may run past its end.
    """

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_start: int
    vocab_rows: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> Shard:
        """Rank ``rank`` of ``size``; raises ``ValueError`` for a model that does not split ``size`` ways."""
        for what, n in (("attention heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % size:
                raise ValueError(f"tensor_parallel_size={size} does not divide the model's {what} ({n})")
        kv = cfg.num_kv_heads
        if kv % size == 0:
            num_kv, kv_start = kv // size, rank * (kv // size)
        elif size % kv == 0:
            num_kv, kv_start = 1, rank // (size // kv)
        else:
            raise ValueError(
                f"tensor_parallel_size={size} and the model's {kv} KV heads do not divide one another"
            )
        vocab_rows = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            head_dim=cfg.head_dim,
            num_heads=cfg.num_heads // size,
            num_kv_heads=num_kv,
            kv_head_start=kv_start,
            intermediate_size=cfg.intermediate_size // size,
            vocab_start=rank * vocab_rows,
            vocab_rows=vocab_rows,
        )


@dataclass(frozen=True)
class ColumnFamily:
    """A column-parallel GEMM of the whole model (qkv, gate_up, the LM head), and the rows of
    its weight that each rank holds at each TP size: under TP-invariant sums its path must give
    a column the same bits whichever of these shards computes it."""

    name: str
    rows: int
    """Rows of the whole model's weight (its output features)."""
    in_features: int
    bias: bool
    shards: dict[tuple[int, int], torch.Tensor]
    """(TP size, rank) -> that rank's rows, as indices into the whole weight; indices from
    ``rows`` on are a vocabulary shard's padding."""


def column_families(cfg: ModelConfig, chunks: int) -> list[ColumnFamily]:
    """The column-parallel GEMMs at every TP size that TP-invariant sums of ``chunks`` cover
    (the powers of two up to ``chunks``), with each rank's rows, as ``Shard.of`` deals them."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv, gate_up, vocab = {}, {}, {}
    for size in (1 << i for i in range(chunks.bit_length())):
        for rank in range(size):
            sh = Shard.of(cfg, rank, size)
            q_rows = torch.arange(sh.q_size) + rank * sh.q_size
            kv_rows = torch.arange(sh.kv_size) + sh.kv_head_start * cfg.head_dim
            qkv[size, rank] = torch.cat([q_rows, q + kv_rows, q + kv + kv_rows])
            mlp = torch.arange(sh.intermediate_size) + rank * sh.intermediate_size
            gate_up[size, rank] = torch.cat([mlp, inter + mlp])
            vocab[size, rank] = torch.arange(sh.vocab_rows) + sh.vocab_start
    return [
        ColumnFamily("qkv", q + 2 * kv, cfg.hidden_size, cfg.qkv_bias, qkv),
        ColumnFamily("gate_up", 2 * inter, cfg.hidden_size, False, gate_up),
        ColumnFamily("lm_head", cfg.vocab_size, cfg.hidden_size, False, vocab),
    ]


def _row_parallel(tp: TensorParallel | None, layer: Linear, x: torch.Tensor, canonical: bool) -> torch.Tensor:
    """A row-parallel layer (o_proj, down_proj: no bias) summed over the ranks; with
    TP-invariant chunks, in a pass with canonical rows, as one tree of K chunks (``Gemms.row_parallel``)."""
    partial = layer.gemms.row_parallel(x, layer, canonical)
    if tp is None:
        return partial
    if canonical and layer.gemms.k_chunks is not None:
        return tp.all_reduce_tree(partial)
    return tp.all_reduce_sum(partial, canonical)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, layer: int, tp: TensorParallel | None, gemms: Gemms) -> None:
        super().__init__()
        self.cfg, self.shard, self.tp = cfg, shard, tp
        self.layer = layer
        self.qkv_proj = Linear(cfg.hidden_size, shard.q_size + 2 * shard.kv_size, cfg.qkv_bias, gemms)
        self.o_proj = Linear(shard.q_size, cfg.hidden_size, False, gemms)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: PagedAttention
    ) -> torch.Tensor:
        cfg, shard = self.cfg, self.shard
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([shard.q_size, shard.kv_size, shard.kv_size], dim=-1)
        q = q.view(n, shard.num_heads, cfg.head_dim)
        k = k.view(n, shard.num_kv_heads, cfg.head_dim)
        v = v.view(n, shard.num_kv_heads, cfg.head_dim)
        norms = (self.q_norm, self.k_norm) if cfg.qk_norm else (None, None)
        out = attn(self.layer, q, k, v, QKRope(positions, rotary, *norms))
        return _row_parallel(self.tp, self.o_proj, out.reshape(n, shard.q_size), attn.canonical)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, tp: TensorParallel | None, gemms: Gemms) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * shard.intermediate_size, False, gemms)
        self.down_proj = Linear(shard.intermediate_size, cfg.hidden_size, False, gemms)

    def forward(self, x: torch.Tensor, canonical: bool) -> torch.Tensor:
        return _row_parallel(self.tp, self.down_proj, silu_and_mul(self.gate_up_proj(x)), canonical)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, layer: int, tp: TensorParallel | None, gemms: Gemms) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, layer, tp, gemms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, tp, gemms)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: PagedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, residual)``: the layer's input is ``x + residual`` (just ``x`` when
        ``residual`` is None, the first layer); the adds are fused into the norms."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, rotary, attn), residual)
        return self.mlp(h, attn.canonical), residual


class CausalLM(nn.Module):
    """Decoder-only transformer with an LM head (tied or untied); one rank's shard under ``tp``.

    ``gemms`` holds the GEMM paths of every projection and the LM head: the runner switches
    it to the row-invariant paths for passes that carry deterministic rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.shard = Shard.of(cfg) if tp is None else Shard.of(cfg, tp.rank, tp.size)
        self.gemms = Gemms()
        vocab_rows = self.shard.vocab_rows
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.shard, i, tp, self.gemms) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab_rows, False, self.gemms)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` before the final norm."""
        x, residual = self.embed(input_ids, attn.canonical), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        return x + residual

    def embed(self, input_ids: torch.Tensor, canonical: bool) -> torch.Tensor:
        """Token embeddings; under TP each rank looks up its vocabulary rows, zeros elsewhere, summed."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_sum(x, canonical)

    def gemm_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every GEMM the model runs, the LM head included."""
        layers = [(m.weight, m.bias) for m in self.modules() if isinstance(m, Linear)]
        layers += [(w, None) for w in self.chunk_weights()]
        return layers if self.lm_head is not None else [*layers, (self.embed_tokens.weight, None)]

    def chunk_weights(self) -> list[torch.Tensor]:
        """The row-parallel layers' K chunks (``split_row_parallel``): the same shapes at every TP size."""
        return [w for m in self.modules() if isinstance(m, Linear) for w in m.chunks]

    def split_row_parallel(self, chunks: int) -> None:
        """TP-invariant sums (``Gemms.row_parallel``): o_proj and down_proj split their K into
        ``chunks`` in all, this rank's share of them kept as chunks of its weights."""
        cfg = self.cfg
        if cfg.num_kv_heads % chunks:
            raise ValueError(
                f"tp_invariant_chunks={chunks} must divide the model's KV heads ({cfg.num_kv_heads}), so that "
                "every TP size it covers splits them and a query head attends in the same grouping at each"
            )
        if cfg.intermediate_size % chunks:
            raise ValueError(f"tp_invariant_chunks={chunks} does not divide the model's intermediate_size")
        local = chunks // self.shard.size
        for layer in self.layers:
            layer.self_attn.o_proj.split(local)
            layer.mlp.down_proj.split(local)
        self.gemms.k_chunks = local

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32 logits; under TP every rank gets the full vocabulary."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.gemms.linear(self.norm(hidden), weight).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_cat(logits, -1)[:, : self.cfg.vocab_size]
