"""Engine settings, with vLLM's names and defaults where they exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sid.engine.plan import PassSizes
from sid.kernels import HAS_TRITON

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    tp_invariant_chunks: int | None = None
    """Deterministic requests get the same bits at every TP size that divides this: the
    row-parallel layers of passes with canonical rows split their K into this many chunks,
    summed in one fixed tree (TP=1 computes every chunk itself). A power of two; None = off."""
    collective_timeout_s: float = 120.0
    """Under TP, how long a collective waits for a rank before the step fails: a hung worker
    becomes an error after this long."""
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    """Plan and launch step N+1 while the GPU runs step N; None = on for CUDA devices."""
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    cpu_kv_cache_bytes: int = 1 << 30
    enable_determinism: bool = True
    canonical_rows: int | None = None
    """``M_canon``, the smallest pass that carries deterministic rows; None = 1 where the GEMMs
    are proven row-invariant at every row count, else 128 on a GPU and 32 on a CPU."""
    max_canonical_rows: int | None = None
    """Largest canonical pass; None = ``max_num_batched_tokens`` on a GPU or with proven GEMMs
    (a step's prompt rows fit one pass, as in the fast lane), 8x ``M_canon`` on a CPU (256 rows)."""
    canonical_sizes_per_octave: int | None = None
    """Pass sizes per doubling above ``M_canon``; None = with proven GEMMs 16 on a GPU (1, 2,
    ..., 16, 17, ..., 32, 34, ...: a pass carrying deterministic rows is padded by at most
    1/16) and 8 on a CPU (the proof runs every size); else 8 on a GPU (128, 144, ..., 256,
    288, ...) and 1 on a CPU (32, 64, 128, 256)."""
    verify_window: int = 8
    determinism_strategy: str = "auto"
    """``auto``: deterministic rows ride in ordinary passes where the GEMMs are proven
    row-invariant, else the cheapest windowed strategy each step; ``ride``; or a windowed
    strategy, ``speculate``, ``direct`` or ``whole``, even where rows could ride."""
    router_policy: Any = None
    """A ``RouterPolicy``, its dict form, or a path to its JSON file; None = nothing by default."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes must be >= 1, got {self.cpu_kv_cache_bytes}")
        chunks = self.tp_invariant_chunks
        if chunks is not None:
            if chunks < 1 or chunks & (chunks - 1):
                raise ValueError(f"tp_invariant_chunks must be a power of two, got {chunks}")
            if chunks % self.tensor_parallel_size:
                raise ValueError(
                    f"tp_invariant_chunks={chunks} needs a tensor_parallel_size that divides it, "
                    f"got {self.tensor_parallel_size}"
                )
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.canonical_rows is not None and self.canonical_rows < 1:
            raise ValueError(f"canonical_rows must be >= 1, got {self.canonical_rows}")
        for name in ("max_canonical_rows", "canonical_sizes_per_octave"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.verify_window < 1:
            raise ValueError(f"verify_window must be >= 1, got {self.verify_window}")
        if self.attention_backend == "triton" and not HAS_TRITON:
            raise ValueError("attention_backend='triton' needs Triton, and it is not installed: pip install 'sid[gpu]'")

    def torch_device(self) -> torch.device:
        """The device to run on, refused here (naming the setting) where the engine could not run."""
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(auto if self.device == "auto" else self.device)
        except RuntimeError as exc:
            raise ValueError(f"device={self.device!r} is not a device: use auto, cpu, cuda or cuda:N") from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: Sid runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but no CUDA device is available")
        if device.type == "cuda" and not HAS_TRITON:
            raise ValueError("device='cuda' runs Triton kernels, and Triton is not installed: pip install 'sid[gpu]'")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device={self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        if self.attention_backend == "triton" and device.type == "cpu":
            from triton import knobs

            if not knobs.runtime.interpret:
                raise ValueError(
                    "attention_backend='triton' on the CPU runs only in Triton's interpreter (TRITON_INTERPRET=1); "
                    "use 'torch' or 'auto'"
                )
        return device

    def canonical_sizes_for(self, device: torch.device, proven: bool) -> PassSizes:
        """The pass sizes that may carry deterministic rows.

        With GEMMs ``proven`` row-invariant at every row count (``sid.runtime.gemm``), every pass
        that carries a deterministic row is padded to one of these, so they reach from ``M_canon`` =
        1 past the step's token budget, 16 to each doubling on a GPU and 8 on a CPU. Otherwise they
        are the canonical passes' sizes: ``M_canon`` = 128 rows on a GPU (a pass costs about one
        decode step; cuBLASLt gives rows the bits of a 128-row pass at every size from 128 on, not
        below) or 32 on a CPU, and larger passes carry prompts and whole steps in few launches; on a
        GPU they are finely spaced, so a whole canonical step is padded about as much as a fast-lane
        graph."""
        cuda = device.type == "cuda"
        if proven:
            base = self.canonical_rows or 1
            graph_batch = min(self.max_num_seqs, 256)  # the largest decode graph
            largest = max(base, self.max_num_batched_tokens, graph_batch, self.max_canonical_rows or 0)
            return PassSizes.grid(base, largest, self.canonical_sizes_per_octave or (16 if cuda else 8), cover=True)
        base = self.canonical_rows or (128 if cuda else 32)
        largest = self.max_canonical_rows or (max(base, self.max_num_batched_tokens) if cuda else 8 * base)
        return PassSizes.grid(base, largest, self.canonical_sizes_per_octave or (8 if cuda else 1))

    def async_scheduling_for(self, device: torch.device) -> bool:
        """Overlap pays only where kernels run asynchronously to the host. Under tensor
        parallelism rank 0 broadcasts each step's resolved input ids to the workers on the
        device (``ModelRunner.forward``)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda"

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[self.dtype]
