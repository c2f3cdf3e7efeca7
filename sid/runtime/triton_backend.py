"""The GPU attention backend: Triton KV store and paged attention (fast and canonical)."""

from __future__ import annotations

import torch

from sid.kernels.paged_attention import CANONICAL_CONFIG, plan_attention, run_attention
from sid.kernels.rotary import rope_and_store
from sid.model.layers import QKRope
from sid.runtime.attention import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @property
    def probe_keys(self) -> int:
        """Rows in two canonical splits, the second ending mid-tile: the fold of a row's
        splits and the combine run in the self-test's passes (a 101-token probe stayed in
        one split)."""
        return int(CANONICAL_CONFIG["kv_split"]) + int(CANONICAL_CONFIG["kv_tile"]) // 2

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
        """The norms, the rotation and the store in one launch."""
        cos, sin = rope.rotary.cos, rope.rotary.sin
        rope_and_store(q, k, v, cos, sin, rope.positions, k_cache, v_cache, slots, rope.norms)

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
        """Prompt chunks read their own keys from ``k``/``v`` (contiguous rows), the cached
        prefix through the block table. The launches are planned in the step's first layer
        and replayed by the others (``AttentionPlan``)."""
        plan = meta.memo.get(self.name)
        if plan is None:
            plan = meta.memo[self.name] = plan_attention(
                q, k_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, canonical=meta.canonical,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, schedules=meta.schedules,
                own_keys=k is not None and v is not None, num_decodes=meta.num_decodes,
                part_schedules=meta.part_schedules,
            )  # fmt: skip
        return run_attention(plan, q, k_cache, v_cache, scale, out=out, k=k, v=v)

    def canonical_config(self) -> dict[str, object]:
        return {"backend": self.name, **CANONICAL_CONFIG}
