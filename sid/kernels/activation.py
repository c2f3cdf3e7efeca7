"""Triton SwiGLU: ``silu(gate) * up`` on the merged ``[gate | up]`` projection, in one launch.

Semantics of ``sid.kernels.layers_ref.silu_and_mul_ref`` (torch's ``F.silu(gate) * up``):
SiLU computed in float32 as ``g / (1 + exp(-g))`` and rounded to the input dtype, then the
product computed in float32 and rounded again.

The grid is (row, column block); the arithmetic is elementwise, so an element's bits depend
on its own gate and up values only, never on the batch or the blocking.

Floor: ``rows * 3 * I * bytes`` (gate and up read, the product written). For Llama-3.1-8B
(I = 14336, bf16) that is 84 KiB per row: a 256-row decode step takes at least 6.0 us at
3.7 TB/s, an 8192-row prefill 190 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024
"""Columns per program (fewer when ``I`` is smaller)."""


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in_n,
    stride_in_d,
    stride_out_n,
    stride_out_d,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, block of ``BLOCK`` output columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate_ptrs = gate_up_ptr + row * stride_in_n + cols * stride_in_d
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + INTER * stride_in_d, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out_n + cols * stride_out_d,
        (silu * up).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of ``gate_up`` ``[N, 2I]`` into ``out`` ``[N, I]`` (allocated if None); any strides."""
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows > 0:
        block = min(_MAX_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(num_rows, -(-inter // block))](
            gate_up,
            out,
            *gate_up.stride(),
            *out.stride(),
            INTER=inter,
            BLOCK=block,
        )
    return out
