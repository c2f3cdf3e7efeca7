"""Triton RMSNorm, optionally fused with the residual add (vLLM's ``fused_add_rms_norm``).

Semantics of ``sid.kernels.layers_ref.rms_norm_ref``: the row is normalised in float32,
rounded to its dtype, then multiplied by the weight (float32 product, rounded). With a
residual, ``x + residual`` is rounded to the dtype first, stored back into ``residual`` and
normalised, so the decoder keeps its residual stream without a separate add.

One program per row, with the whole row in one block (``next_power_of_2(D)``) and launch
constants that depend on ``D`` only: a row's bits are a function of that row alone, never
of the batch. Rows may be the ``[N, H, D]`` heads of a strided q/k view (Qwen3's q/k norm).

Floor: a pass moves ``rows * D * bytes`` read plus as much written (the weight stays in
cache); the fused add reads and writes twice that. For Llama-3.1-8B (hidden 4096, bf16)
that is 16 KiB per row plain and 32 KiB fused: a 256-row decode step takes at least 1.1 /
2.3 us at 3.7 TB/s, an 8192-row prefill 36 / 73 us. Decode is bound by launch latency.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_rn,
    stride_rh,
    stride_rd,
    stride_on,
    stride_oh,
    stride_od,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One program per row ``(n, h)``: optional residual add, then the norm, all in registers."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + n * stride_xn + h * stride_xh + cols * stride_xd, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + n * stride_rn + h * stride_rh + cols * stride_rd
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + n * stride_on + h * stride_oh + cols * stride_od,
        (weight * normed).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of ``t`` seen as ``[N, H, D]`` (a 2-D tensor is ``[N, 1, D]``)."""
    return (t.stride(0), 0, t.stride(1)) if t.dim() == 2 else t.stride()


def _num_warps(block: int) -> int:
    """Warps per row: ~16 elements a thread for hidden-size rows, one warp for a head."""
    return min(max(block // 512, 1), 8)


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None, out: torch.Tensor | None = None
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x`` ``[N, D]`` or ``[N, H, D]`` (any strides); one launch.

    ``weight`` is a contiguous ``[D]`` in ``x``'s dtype. Without ``residual`` returns the
    norm; with it, ``x + residual`` is written into ``residual`` and ``(norm of that,
    residual)`` is returned.
    The norm goes to ``out`` (allocated if None, shaped like ``x``); ``out`` may be ``x``
    itself, since each program reads its row before writing it.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (x.shape[0], x.shape[1] if x.dim() == 3 else 1)
    res = x if residual is None else residual
    if grid[0] * grid[1] > 0:
        block = triton.next_power_of_2(x.shape[-1])
        _rms_norm_kernel[grid](
            x,
            res,
            weight,
            out,
            eps,
            *_row_strides(x),
            *_row_strides(res),
            *_row_strides(out),
            D=x.shape[-1],
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=_num_warps(block),
        )
    return out if residual is None else (out, residual)
