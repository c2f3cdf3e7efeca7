"""Fault injection for tests: perturbations that prove the determinism checks can fail.

Production never sets these. Tests set them to show that (a) the fast lane really is
perturbed by batch composition yet deterministic outputs do not move, (b) a canonical
pass whose rows can see each other, or whose bits change with its size, makes the start-up
self-test refuse, and (c) without a proof of row-invariant GEMMs the engine falls back to
windowed verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Faults:
    fast_lane_logit_noise: float = 0.0
    """Noise added to fast-lane logits, drawn from a generator seeded by the batch size."""
    canonical_cross_row: float = 0.0
    """Added to the logits of canonical passes and of passes with riding rows, scaled by a
    function of every input token in the pass."""
    broken_pass_size: int = 0
    """Canonical passes of this many rows get perturbed logits: one size that changes bits."""
    fast_attention_noise: float = 0.0
    """Noise added to the attention output of rows on the fast schedule, seeded by the row count."""
    fast_gemm_noise: float = 0.0
    """Noise added to GEMMs on the fast lane's path, seeded by the row count."""
    no_invariant_gemms: bool = False
    """No GEMM path proves row-invariant: deterministic rows cannot ride."""
    fast_gemm_tile: int = 0
    """The fast lane's GEMMs run in calls of this many rows: a machine whose GEMMs keep a row's
    bits at every row count from that size on, whatever its own GEMMs do (tests of the windowed
    lane's pass sizes, which would otherwise depend on the CPU they run on)."""


def batch_noise(like: torch.Tensor, scale: float) -> torch.Tensor:
    """Noise of ``like``'s shape, seeded by its row count: it changes with the batch."""
    gen = torch.Generator(device=like.device).manual_seed(like.shape[0])
    return scale * torch.randn(like.shape, generator=gen, device=like.device).to(like.dtype)


FAULTS = Faults()
