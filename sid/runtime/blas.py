"""The GEMM library: cuBLASLt, whose kernels give a row the same bits at any row count.

Canonical passes come in several sizes (``PassSizes``), which holds only if a GEMM gives a
row the same bits whatever the number of rows M. Through torch's default cuBLAS path the
H200 picks split-K kernels for some shapes at small M (Llama-3.1-8B's down projection below
384 rows, Qwen3-0.6B's at 128), so a row's bits change with M; through cuBLASLt every GEMM
shape of both models gave the same bits for M = 128 ... 4,096, at the same speed
(``benchmarks/pass_invariance.py``). The start-up self-test checks it on the machine it runs
on. The choice is process-wide in torch, so it applies to the fast lane too.
"""

from __future__ import annotations

import torch


def use_row_invariant_gemms(device: torch.device) -> str:
    """Select the GEMM library for ``device``; returns its name, which the fingerprint records."""
    if device.type != "cuda":
        return "cpu"
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return "cublaslt"
