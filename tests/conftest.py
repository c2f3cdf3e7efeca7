"""Test set-up: Triton runs in its interpreter when there is no GPU (CI is CPU-only)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
