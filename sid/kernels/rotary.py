"""Triton rotary embedding: rotate a step's queries and keys in place, in one launch, and
optionally normalise them first (Qwen3's per-head q/k norm) and write the keys and values
into the paged KV cache in the same launch (``rope_and_store``).

Semantics of ``sid.kernels.layers_ref``: the per-head norm of ``rms_norm_ref`` (float32,
rounded, times the weight, rounded), then ``apply_rotary_ref``: non-interleaved
(``rotate_half``, NeoX) rotation in float32 from float32 ``cos`` / ``sin`` tables
``[max_positions, D]``, rounded back to the input dtype; then ``store_kv_ref``. ``q``, ``k``
and ``v`` may be strided views of the merged qkv projection; q and k are updated where they
lie (attention reads a prompt's own keys from ``k``), so the decoder needs no copies.

One program per token and KV head does that key head, its values and the query heads that
share it (the GQA group), so a decode step of one token still spreads over several
multiprocessors; the arithmetic is per head, so a token's bits depend on its own values and
position only, never on the batch.

Floor: every q and k element is read and written once, plus one cos and one sin row per
token, and with the store K and V written once more. For Llama-3.1-8B (32 query and 8 KV
heads of 128, bf16) that is 21 KiB per token (29 KiB with the store): a 256-token decode step
takes at least 1.5 us at 3.7 TB/s, an 8192-token prefill 48 us. Decode is bound by launch
latency, which is why the norm and the store ride in this launch instead of three more. On
the H200 (16-call graphs, 2026-12-03) the separate launches took 2.9 us for one token of
Llama-3.1-8B's heads and 6.3 us for one of Qwen3-0.6B's with its q/k norm, this one 2.3 and
2.5 us; 8,192 tokens 65 and 167 us against 65 and 50.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sid.kernels.kv_store import store_heads


@triton.jit
def _rotate_heads(
    ptr, token, strides, cos1, cos2, sin1, sin2, weight_ptr, eps,
    NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, HALF_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Rotate ``NUM_HEADS`` heads of one token in place (``ptr``: the first of them): halves
    ``(x1, x2)`` become ``(x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2)``; with ``NORM``,
    each head is first RMS-normalised and weighted (``weight_ptr``), rounded as the separate
    norm would store it. Returns the rotated halves, in the input dtype."""
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF_DIM)
    first = ptr + token * strides[0] + heads * strides[1] + dims * strides[2]
    second = first + HALF_DIM * strides[2]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF_DIM) + eps)[:, None]
        w1 = tl.load(weight_ptr + dims, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF_DIM + dims, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
        dtype = ptr.dtype.element_ty
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1 = (x1 * cos1 - x2 * sin1).to(ptr.dtype.element_ty)
    y2 = (x2 * cos2 + x1 * sin2).to(ptr.dtype.element_ty)
    tl.store(first, y1, mask=mask)
    tl.store(second, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, q_weight_ptr, k_weight_ptr, eps,
    cos_ptr, sin_ptr, positions_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    GROUP: tl.constexpr, GROUP_HEADS: tl.constexpr, HALF_DIM: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """One program per token and KV head: the token's cos/sin row, then the KV head's GQA
    group of ``GROUP`` query heads and the key head; with ``STORE``, the rotated key and the
    values into the token's cache slot (none for slot -1)."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    dim_ok = dims < HALF_DIM
    cos_row = cos_ptr + pos * stride_cos_p + dims * stride_cos_d
    sin_row = sin_ptr + pos * stride_sin_p + dims * stride_sin_d
    cos1 = tl.load(cos_row, mask=dim_ok, other=0.0)
    cos2 = tl.load(cos_row + HALF_DIM * stride_cos_d, mask=dim_ok, other=0.0)
    sin1 = tl.load(sin_row, mask=dim_ok, other=0.0)
    sin2 = tl.load(sin_row + HALF_DIM * stride_sin_d, mask=dim_ok, other=0.0)
    _rotate_heads(
        q_ptr + kv_head * GROUP * stride_qh, token, (stride_qt, stride_qh, stride_qd), cos1, cos2, sin1, sin2,
        q_weight_ptr, eps, GROUP, GROUP_HEADS, HALF_DIM, HALF, NORM,
    )  # fmt: skip
    k1, k2 = _rotate_heads(
        k_ptr + kv_head * stride_kh, token, (stride_kt, stride_kh, stride_kd), cos1, cos2, sin1, sin2, k_weight_ptr,
        eps, 1, 1, HALF_DIM, HALF, NORM,
    )  # fmt: skip
    if STORE:
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            kc = (stride_kcb, stride_kcs, stride_kch, stride_kcd)
            vc = (stride_vcb, stride_vcs, stride_vch, stride_vcd)
            store_heads(k_cache_ptr, slot, k1, kv_head, dims, dim_ok, kc, BLOCK_SIZE)
            store_heads(k_cache_ptr, slot, k2, kv_head, dims + HALF_DIM, dim_ok, kc, BLOCK_SIZE)
            v_row = v_ptr + token * stride_vt + kv_head * stride_vh + dims * stride_vd
            v1 = tl.load(v_row, mask=dim_ok)
            v2 = tl.load(v_row + HALF_DIM * stride_vd, mask=dim_ok)
            store_heads(v_cache_ptr, slot, v1, kv_head, dims, dim_ok, vc, BLOCK_SIZE)
            store_heads(v_cache_ptr, slot, v2, kv_head, dims + HALF_DIM, dim_ok, vc, BLOCK_SIZE)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate ``q`` ``[N, H, D]`` and ``k`` ``[N, KVH, D]`` in place (any strides); one launch.

    ``cos`` / ``sin``: float32 ``[max_positions, D]``; ``positions``: integer ``[N]``, any
    order. Tables and positions are read, never written.
    """
    _launch(q, k, cos, sin, positions)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """``apply_rotary`` (after the per-head norms ``(q_weight, k_weight, eps)`` where given, in
    place too), then the rotated keys and ``v`` into their cache slots as ``store_kv`` writes
    them (slot -1: nowhere); one launch."""
    _launch(q, k, cos, sin, positions, norms, (v, k_cache, v_cache, slot_mapping))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
    group = num_heads // num_kv_heads
    # Without norms or a store the kernel never reads those arguments: any tensor stands in.
    q_weight, k_weight, eps = (q, k, 0.0) if norms is None else norms
    v, k_cache, v_cache, slots = (k, k, k, positions) if store is None else store
    cache_strides = (0,) * 4 if store is None else (*k_cache.stride(), *v_cache.stride())
    _rotary_kernel[(num_tokens, num_kv_heads)](
        q, k, v, k_cache, v_cache, slots, q_weight, k_weight, eps, cos, sin, positions,
        *q.stride(), *k.stride(), *v.stride(), *cache_strides[:4], *cache_strides[-4:], *cos.stride(), *sin.stride(),
        GROUP=group,
        GROUP_HEADS=triton.next_power_of_2(group),
        HALF_DIM=head_dim // 2,
        HALF=triton.next_power_of_2(head_dim // 2),
        NORM=norms is not None,
        STORE=store is not None,
        BLOCK_SIZE=1 if store is None else k_cache.shape[1],
        num_warps=1 if group * head_dim <= 512 else 2,
    )  # fmt: skip
