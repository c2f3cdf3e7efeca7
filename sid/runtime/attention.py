"""Attention backends over the paged KV cache.

A backend stores a layer's new K/V into the cache and then attends *from the cache*, for
every row of a mixed step (prefill chunks and decodes together). Each backend offers the
fast schedule and the canonical one (DESIGN 3.1), chosen per sequence: a pass may hold a
deterministic request's rows, attending canonically, beside normal rows (DESIGN 1b).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from sid.kernels.attention_ref import (
    CANONICAL_KV_TILE,
    CanonicalPlan,
    canonical_plan,
    paged_attention_canonical_ref,
    paged_attention_ref,
    segment_of,
    store_kv_ref,
)
from sid.model.decoder import CausalLM
from sid.model.layers import QKRope
from sid.runtime.faults import FAULTS, batch_noise


@dataclass
class AttentionMetadata:
    """Where a step's rows live in the cache; see ``sid.kernels.attention_ref`` for the layout."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = write nothing (padding rows)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, context length including this step's rows
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    """How many of the first sequences have one query row each (0: none known). Beside prompt
    rows a backend may give them a decode-shaped launch of their own."""
    canonical: bool | torch.Tensor = False
    """The canonical schedule for every sequence (True), for none (False), or per sequence:
    an int32 ``[S]`` tensor, 1 = canonical (then ``schedules`` says which occur)."""
    schedules: tuple[bool, bool] = (True, True)
    """(any fast sequence, any canonical one), when ``canonical`` is a tensor."""
    part_schedules: tuple[tuple[bool, bool], tuple[bool, bool]] | None = None
    """``schedules`` of the first ``num_decodes`` sequences and of the rest, for a backend that
    launches the two apart (None: both may hold both)."""
    memo: dict[str, object] = field(default_factory=dict, repr=False)
    """Work that depends on this metadata alone, done by a backend in the first layer and
    reused by the others (the torch backend's split of the rows by schedule, the Triton
    backend's launches)."""

    @property
    def any_canonical(self) -> bool:
        return self.canonical if isinstance(self.canonical, bool) else self.schedules[1]


class AttentionBackend(ABC):
    name: str

    @property
    def probe_keys(self) -> int:
        """Keys the start-up self-test's probe holds at least, so that its rows cross every
        boundary of the canonical schedule (none beyond its tiles here)."""
        return 0

    def rope_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: QKRope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Apply ``rope`` to ``q`` and ``k`` in place, then write each row's K/V at its cache
        slot (``AttentionMetadata.slot_mapping``; -1: nowhere). Here one step after the other;
        a backend may fuse them."""
        rope.apply(q, k)
        store_kv_ref(k, v, k_cache, v_cache, slots)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the step's rows over the cache, which already holds this step's K/V;
        ``k``/``v`` are those same keys and values, which a backend may read from instead.
        Written into ``out`` when given (and returned)."""

    @abstractmethod
    def canonical_config(self) -> dict[str, object]:
        """Constants that fix the canonical reduction order (part of the fingerprint)."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: SDPA per sequence (fast), tiled online softmax (canonical)."""

    name = "torch"

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        parts = meta.memo.get(self.name)
        if parts is None:
            parts = meta.memo[self.name] = _schedule_parts(q, k_cache, meta)
        assert isinstance(parts, list)
        if len(parts) == 1 and parts[0].rows is None and out is None:
            return parts[0].attend(q, k_cache, v_cache, scale)
        out = torch.empty_like(q) if out is None else out
        for part in parts:
            if part.rows is None:
                out.copy_(part.attend(q, k_cache, v_cache, scale))
            else:
                out[part.rows] = part.attend(q[part.rows], k_cache, v_cache, scale)
        return out

    def canonical_config(self) -> dict[str, object]:
        return {"backend": self.name, "kv_tile": CANONICAL_KV_TILE}


@dataclass
class _SchedulePart:
    """The rows of a step that attend with one schedule, and the metadata of a batch of
    their sequences alone."""

    rows: torch.Tensor | None
    """Their rows of the step; None: all of them."""
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    plan: CanonicalPlan | None
    """The canonical reference's index work for them; None: the fast schedule."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        args = (q, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc, scale)
        return paged_attention_ref(*args) if self.plan is None else paged_attention_canonical_ref(*args, plan=self.plan)


def _schedule_parts(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> list[_SchedulePart]:
    """A step's rows split by schedule (``meta.canonical``), each with its metadata and, for
    the canonical one, its plan: the same for every layer."""
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    heads = q.shape[1]
    if isinstance(meta.canonical, bool):
        return [_SchedulePart(None, *args, canonical_plan(heads, k_cache, *args) if meta.canonical else None)]
    qsl = meta.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    row_flags = meta.canonical[segment_of(qsl[1:], torch.arange(q.shape[0], dtype=qsl.dtype, device=qsl.device))]
    parts = []
    for flag in (0, 1):
        seqs = (meta.canonical == flag).nonzero()[:, 0] if meta.schedules[flag] else None
        if seqs is None or not len(seqs):
            continue
        lens = q_lens[seqs]
        sub = (
            meta.block_tables[seqs], meta.seq_lens[seqs], torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(qsl.dtype)
        )
        rows = (row_flags == flag).nonzero()[:, 0]
        parts.append(_SchedulePart(rows, *sub, canonical_plan(heads, k_cache, *sub) if flag else None))
    return parts


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` is Triton on CUDA when it is importable, the torch reference otherwise."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name in ("auto", "triton"):
        from sid.runtime.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; use 'auto', 'torch' or 'triton'")


class PagedKVCache:
    """Per-layer K/V tensors ``[num_blocks, block_size, kv_heads, head_dim]`` and the backend."""

    def __init__(
        self,
        backend: AttentionBackend,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.backend = backend
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: masked-out keys in a tile must be finite (0 * NaN would leak).
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scale = head_dim**-0.5
        self.meta: AttentionMetadata | None = None

    @classmethod
    def for_model(
        cls,
        backend: AttentionBackend,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedKVCache:
        """A cache for ``model``'s layers and this rank's KV heads."""
        return cls(
            backend,
            num_layers=model.cfg.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.shard.num_kv_heads,
            head_dim=model.cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def canonical(self) -> bool:
        """Whether the pass holds canonical rows: the model's cross-rank sums then keep a fixed order."""
        assert self.meta is not None, "attention metadata must be set before the forward pass"
        return self.meta.any_canonical

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: QKRope) -> torch.Tensor:
        """The model's attention hook: q/k transform and cache first, then attention from the cache."""
        self.store(layer, q, k, v, rope, self._meta().slot_mapping)
        return self.attend(layer, q, k, v)

    def _meta(self) -> AttentionMetadata:
        assert self.meta is not None, "attention metadata must be set before the forward pass"
        return self.meta

    def store(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: QKRope, slots: torch.Tensor
    ) -> None:
        """``rope`` applied to ``q``/``k`` in place, and layer ``layer``'s new K/V into the cache."""
        self.backend.rope_and_store(q, k, v, rope, self.k[layer], self.v[layer], slots)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``layer``'s attention of the step's rows, whose K/V the cache holds already."""
        meta = self._meta()
        out = self.backend.attend(q, self.k[layer], self.v[layer], meta, self.scale, k, v, out)
        if FAULTS.fast_attention_noise and meta.canonical is not True:
            fast = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
            if isinstance(meta.canonical, torch.Tensor):
                q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
                fast = torch.repeat_interleave(meta.canonical == 0, q_lens, output_size=out.shape[0])
            out.add_(batch_noise(out, FAULTS.fast_attention_noise) * fast[:, None, None])
        return out
