"""Triton KV store: scatter a step's keys and values into the paged cache.

Layout as in ``sid.kernels.attention_ref``: ``k_cache`` / ``v_cache`` are
``[num_blocks, block_size, kv_heads, head_dim]`` and ``slot_mapping[i]`` is the flat slot
(``block * block_size + offset``) of token ``i``, or -1 for a token that must not be stored
(padding rows of a canonical pass).

Floor: the store is a pure copy, so its time is at least
``2 * N * kv_heads * head_dim * (input bytes + cache bytes) / HBM bandwidth``;
for a Llama-3.1-8B layer (8 KV heads, head_dim 128, bf16) that is 8 KiB per token,
about 2.2 ns per token at 3.7 TB/s, so a decode step of a few hundred tokens is bound by
launch latency, not bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
):
    """One program per token: its K and V rows, all KV heads, in one go."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims * stride_key_d, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims * stride_value_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h + dims * stride_kc_d
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h + dims * stride_vc_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[N, kv_heads, head_dim]`` into their cache slots (one launch).

    ``slot_mapping`` is int64 ``[N]``; slot -1 is skipped. Values are converted to the cache
    dtype. Any strides are accepted for the inputs and the caches.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS=triton.next_power_of_2(num_kv_heads),
        DIM=triton.next_power_of_2(head_dim),
    )
