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
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims * stride_key_d, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims * stride_value_d, mask=mask)
    kc = (stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d)
    vc = (stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d)
    store_heads(k_cache_ptr, slot, k, heads, dims, mask, kc, BLOCK_SIZE)
    store_heads(v_cache_ptr, slot, v, heads, dims, mask, vc, BLOCK_SIZE)


@triton.jit
def store_heads(cache_ptr, slot, values, heads, dims, mask, strides, BLOCK_SIZE: tl.constexpr):
    """One token's ``values`` (rows ``heads``, columns ``dims`` of its heads) into cache slot
    ``slot``, converted to the cache dtype; ``strides``: the cache's four."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    at = cache_ptr + block * strides[0] + offset * strides[1] + heads * strides[2] + dims * strides[3]
    tl.store(at, values.to(cache_ptr.dtype.element_ty), mask=mask)


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
