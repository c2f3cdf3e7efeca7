"""Shared memory of the attention kernel's launches, lowered for sm_90 on any machine.

Run by ``tests/test_kernels.py`` in a process of its own: Triton compiles only when its
interpreter is off, and the test session has it on. No GPU is needed: Triton's pipeline
for sm_90 runs on the CPU, and its lowering to LLVM IR fixes the shared memory a program asks
for, the figure a launch on the H200 is refused over (``OutOfResources``). The pipeline stops
there: PTX and ``ptxas`` would add a minute on a 2-core machine and change no byte of it.

Each launch is the one ``paged_attention`` makes, caught at the kernel's call (the prompt
launches both as the Triton kernel and as ``hopper_prefill``'s Gluon one, "hopper ..."), and is
specialised by Triton's own binder as the H200 would specialise it: strides of 1 become
constants, pointers and multiples of 16 are marked divisible by 16. That matters: the
canonical prompt launch asked for 102 KB unspecialised and 169 KB specialised (bf16, its own
K/V given, 2026-12-02), because the contiguous loads it can prove become pipelined copies.
Prints JSON: one entry per (launch, dtype) with the bytes asked for (a combine launch, where
the schedule makes one, as a separate entry).

``--registers`` goes on to PTX and runs the ``ptxas`` that ships with Triton (``-v``): the
registers a thread of each bf16 attention launch uses (the Gluon kernel's partitions then set
their own with ``setmaxnreg``), the bytes it spills, and whether ptxas
serialised its wgmma instructions, which decide how fast a program runs and are not seen
without a GPU otherwise (2026-12-02: the canonical prompt launch 255 registers and 1,544 bytes
of spill stores a thread, the fast one 16; 2026-12-03: the canonical prompt launch's wgmmas
serialised, each waiting for the one before, by a branch that folded a split's state).

    python tests/sm90_shared_memory.py [--registers]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sid.kernels import hopper_prefill  # noqa: E402
from sid.kernels import paged_attention as attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
"""Llama-3.1-8B's attention: GQA 4, head_dim 128, the largest tiles Sid's models ask for."""
SM90 = GPUTarget("cuda", 90, 32)
DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
"""The matrix unit's operand type on CUDA: the query's (``_dot_dtype`` off CUDA differs)."""


class _Caught:
    """Stands in for the kernel: keeps the arguments of the launch instead of running it."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""(kernel, positional arguments, keyword arguments) of one launch."""


def launches(dtype: torch.dtype, canonical: bool, query_len: int, hopper: bool = False) -> list[Launch]:
    """The kernels' launches for 8 sequences of ``query_len`` rows after a 512-key prefix
    (their own K/V given, as the engine gives them), in one schedule; ``hopper``: the prompt
    launch as ``hopper_prefill``'s kernel (the canonical one called directly), else as the
    Triton one."""
    seqs, prefix = 8, 512
    context = prefix + query_len
    blocks = -(-context // BLOCK)
    cache = torch.zeros(seqs * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    table = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
    q = torch.zeros(seqs * query_len, HEADS, HEAD_DIM, dtype=dtype)
    own = torch.zeros(seqs * query_len, KV_HEADS, HEAD_DIM, dtype=dtype)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    starts = torch.arange(0, seqs * query_len + 1, query_len, dtype=torch.int32)
    modules = {"_attention_kernel": attention, "_combine_kernel": attention, "_prefill_kernel": hopper_prefill}
    kernels = {name: getattr(module, name) for name, module in modules.items()}
    caught = {name: _Caught() for name in kernels}
    for name, module in modules.items():
        setattr(module, name, caught[name])
    attention.HOPPER_PREFILL = hopper
    try:
        if hopper and canonical:  # the plan keeps canonical launches on Triton: the kernel's call
            hopper_prefill.prefill_attention(q, own, own, cache, cache, table, seq_lens, starts,
                                             torch.ones_like(seq_lens), 0.1, torch.empty_like(q),
                                             canonical=attention.hopper_canonical(HEADS // KV_HEADS))  # fmt: skip
        else:
            attention.paged_attention(
                q, cache, cache, table, seq_lens, starts, 0.1, canonical=canonical, max_query_len=query_len,
                max_seq_len=context, k=own, v=own,
            )
    finally:
        for name, module in modules.items():
            setattr(module, name, kernels[name])
    found = [(kernels[name], args, kwargs) for name in kernels for args, kwargs in caught[name].calls]
    for _, _, kwargs in found:
        if "DOT_DTYPE" in kwargs:
            kwargs["DOT_DTYPE"] = DOT_DTYPES[dtype]
    return found


def shared_bytes(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of shared memory one program of this launch asks for on sm_90."""
    return _lowered(kernel, args, kwargs, "llir")[1]["shared"]


def _lowered(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], last: str) -> tuple[Any, dict]:
    """``triton.compile``'s stages for sm_90 up to ``last`` ("llir", "ptx"): the module and
    its metadata."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = (GluonASTSource if kernel.is_gluon() else ASTSource)(kernel, signature, constexprs, attrs)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(SM90, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    metadata = {"target": SM90, **options.__dict__}
    for ext, lower in stages.items():
        module = lower(module, metadata)
        if ext == last:
            return module, metadata
    raise RuntimeError(f"no {last} stage for sm_90")


def _descriptors(ptx: str) -> dict[str, Any]:
    """The wgmma shared-memory descriptors of ``ptx`` built from a constant (added to, or-ed
    into or moved to a descriptor register): how many, and their nonzero "matrix base offset"
    fields (bits 49-51). PTX gives 0 for canonical layouts; Triton 3.6 built 2, 4 and 6 for a
    Gluon operand of 16-byte rows without swizzle (the canonical row sum's ones), and the rows
    of that kernel seeing key 32 or later came out wrong on an H100 (2026-12-07)."""
    used = {reg for line in ptx.splitlines() if "wgmma.mma_async" in line for reg in re.findall(r"%rd\d+", line)}
    built = re.findall(r"(?:add\.s64|or\.b64|mov\.b64)\s+(%rd\d+),(?:\s*%rd\d+,)?\s*(-?\d+);", ptx)
    offsets = [(int(imm) % (1 << 64)) >> 49 & 7 for reg, imm in built if reg in used]
    return {"wgmma_descriptors": len(offsets), "descriptor_base_offsets": sorted(set(offsets) - {0})}


def registers(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Registers a thread of this launch uses on sm_90a, its threads (a warp-specialised
    program's every partition, padded to warpgroups), the bytes it spills, whether ptxas
    serialised its wgmma instructions (advisory C7515: each waits for the one before, where
    an instruction other than a wgmma defines an accumulator inside a pipeline stage), and the
    wgmma descriptors (``_descriptors``)."""
    ptx, metadata = _lowered(kernel, args, kwargs, "ptx")
    ptxas = Path(tl.__file__).parents[1] / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return {
        "registers": int(used.group(1)) if used else -1,
        "threads": metadata["num_warps"] * SM90.warp_size,
        "spill_bytes": int(spilled.group(1)) if spilled else 0,
        "wgmma_serialized": "C7515" in report,
        **_descriptors(ptx),
    }


def main() -> None:
    # As on sm_90: the prompt launches take descriptors, and bf16 ones may run as the Gluon kernel.
    attention._has_tma = lambda device: True
    hopper_prefill.supports = lambda q, k_cache: q.dtype == torch.bfloat16
    spills = "--registers" in sys.argv
    found = {}
    for name, canonical, query_len, hopper in (
        ("canonical prompt", True, 512, False), ("fast prompt", False, 512, False),
        ("hopper prompt", False, 512, True), ("hopper canonical prompt", True, 512, True),
        ("canonical decode", True, 1, False), ("fast decode", False, 1, False),
    ):
        for dtype in (torch.bfloat16,) if spills or hopper else (torch.float32, torch.bfloat16):
            for kernel, args, kwargs in launches(dtype, canonical, query_len, hopper):
                which = f"{name if kernel is not attention._combine_kernel else f'{name} combine'} {dtype}"
                measure = registers if spills else shared_bytes
                found[which.replace("torch.", "")] = measure(kernel, args, kwargs)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
