"""Row-wise building blocks of the decoder: RMSNorm, rotary embedding, SwiGLU.

Every op here acts on each token row by itself, so a row's result depends on the other
rows only through the shape of the batch (which the canonical lane fixes). On CUDA they
run as fused Triton kernels (``sid.kernels``), elsewhere as their torch references (a
CPU-only install has no Triton, so the kernels are imported only where it is installed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import torch
from torch import nn

from sid.kernels import HAS_TRITON
from sid.kernels.layers_ref import apply_rotary_ref, rms_norm_ref, silu_and_mul_ref
from sid.model.config import RopeConfig

if HAS_TRITON:
    from sid.kernels.activation import silu_and_mul as triton_silu_and_mul
    from sid.kernels.rms_norm import rms_norm
    from sid.kernels.rotary import apply_rotary
else:  # a CPU-only install; EngineConfig refuses CUDA without Triton, so only the references run
    triton_silu_and_mul, rms_norm, apply_rotary = silu_and_mul_ref, rms_norm_ref, apply_rotary_ref


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face does, then cast back; optionally fused
    with the residual add (``norm(x + residual)``, the sum written into ``residual``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fn = rms_norm if x.is_cuda else rms_norm_ref
        return fn(x, self.weight, self.eps, residual)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, including Llama 3.1's wavelength-dependent rescaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (``rotate_half``) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate ``q`` ``[N, H, D]`` and ``k`` ``[N, KVH, D]`` in place by their token positions."""
        fn = apply_rotary if q.is_cuda else apply_rotary_ref
        fn(q, k, self.cos, self.sin, positions)


@dataclass
class QKRope:
    """What a layer does to its queries and keys before attention: Qwen3's per-head RMSNorm
    where the model has one, then the rotary embedding at the rows' positions. The model hands
    it to its attention hook beside q, k and v, and the hook applies it: in place here
    (``apply``), or fused with writing the keys into the cache (a GPU backend's one launch for
    what would be up to four a layer)."""

    positions: torch.Tensor
    rotary: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Norm (where the model has one) and rotate ``q`` ``[N, H, D]`` and ``k`` ``[N, KVH, D]`` in place."""
        if self.q_norm is not None and self.k_norm is not None:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        self.rotary(self.positions, q, k)

    @property
    def norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) of the per-head norms; None for a model without them."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged ``[gate | up]`` projection."""
    return (triton_silu_and_mul if gate_up.is_cuda else silu_and_mul_ref)(gate_up)
