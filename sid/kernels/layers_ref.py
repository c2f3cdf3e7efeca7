"""Torch references for the decoder's row-wise kernels: RMSNorm (optionally fused with the
residual add), rotary embedding and SwiGLU.

They carry exactly the numerics of ``sid.model.layers`` (Hugging Face's): RMSNorm in
float32, rounded to the input dtype, then multiplied by the weight; rotary in float32 from
float32 cos/sin tables; SiLU rounded to the input dtype before the product. They are the
ground truth for ``sid.kernels.rms_norm``, ``sid.kernels.rotary`` and
``sid.kernels.activation``, and share their signatures and in-place effects, so either can
stand in for the other. Every op acts on each row by itself.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F


@overload
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x``; with ``residual``, of ``x + residual`` instead.

    With ``residual`` the sum (rounded to the dtype) is also written into ``residual`` in
    place, and ``(norm, residual)`` is returned: the pre-norm residual stream in one pass.
    """
    if residual is not None:
        x = residual.copy_(x + residual)
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, residual)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate ``q`` ``[N, H, D]`` and ``k`` ``[N, KVH, D]`` in place (``rotate_half`` style).

    ``cos`` / ``sin`` are float32 ``[max_positions, D]`` tables; row ``i`` uses ``positions[i]``.
    """
    cos_rows = cos[positions].unsqueeze(1)
    sin_rows = sin[positions].unsqueeze(1)
    q.copy_(_rotate(q, cos_rows, sin_rows))
    k.copy_(_rotate(k, cos_rows, sin_rows))


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged ``[gate | up]`` projection ``[N, 2I]``: ``silu(gate) * up``, ``[N, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
