"""Fault injection for tests: perturbations that prove the determinism checks can fail.

Production never sets these. Tests set them to show that (a) the fast lane really is
perturbed by batch composition yet deterministic outputs do not move, and (b) a canonical
pass whose rows can see each other, or whose bits change with its size, makes the start-up
self-test refuse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Faults:
    fast_lane_logit_noise: float = 0.0
    """Noise added to fast-lane logits, drawn from a generator seeded by the batch size."""
    canonical_cross_row: float = 0.0
    """Added to canonical logits, scaled by a function of every input token in the pass."""
    broken_pass_size: int = 0
    """Canonical passes of this many rows get perturbed logits: one size that changes bits."""


FAULTS = Faults()
