"""Shared memory of the attention kernel's prompt launches, lowered for sm_90 on any machine.

Run by ``tests/test_kernels.py`` in a process of its own: Triton compiles only when its
interpreter is off, and the test session has it on. No GPU is needed: Triton's pipeline
for sm_90 runs on the CPU, and its lowering to LLVM IR fixes the shared memory a program asks
for, the figure a launch on the H200 is refused over (``OutOfResources``). The pipeline stops
there: PTX and ``ptxas`` would add a minute on a 2-core machine and change no byte of it.
Prints JSON: one entry per (schedule, dtype) with the bytes asked for.

    python tests/sm90_shared_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import mangle_type

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sid.kernels import paged_attention as attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
"""Llama-3.1-8B's attention: GQA 4, head_dim 128, the largest tiles Sid's models ask for."""
SM90 = GPUTarget("cuda", 90, 32)
DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
"""The matrix unit's operand type on CUDA: the query's (``_dot_dtype`` off CUDA differs)."""


def shared_bytes(sched: attention._Schedule, dtype: torch.dtype, canonical: bool) -> int:
    """Bytes of shared memory one program of ``sched`` asks for, as ``_launch`` would launch it."""
    group = HEADS // KV_HEADS
    cache = torch.zeros(4, 16, KV_HEADS, HEAD_DIM, dtype=dtype)
    own = torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=dtype) if sched.fast_prefill else None
    k_desc, v_desc = attention._tensor_descriptors(own, own, sched.kv_tile, HEAD_DIM) if own is not None else (None, None)
    assert (k_desc is None) == (own is None), "the fast prompt launch reads its own keys through TMA on sm_90"
    values = {
        "q_ptr": torch.zeros(8, HEADS, HEAD_DIM, dtype=dtype), "k_cache_ptr": cache, "v_cache_ptr": cache,
        "k_ptr": own, "v_ptr": own, "k_desc": k_desc, "v_desc": v_desc, "out_ptr": torch.zeros(1, dtype=dtype),
        "part_acc_ptr": torch.zeros(1), "part_max_ptr": torch.zeros(1), "part_sum_ptr": torch.zeros(1),
        "qk_scale": 0.5,
    }
    stages = attention._stages(sched, cache.element_size())
    constants = {
        "BLOCK_SIZE": 16, "GROUP": group, "BLOCK_M": sched.block_m, "BLOCK_Q": sched.block_m // group,
        "TILE": sched.kv_tile, "HEAD_DIM": HEAD_DIM, "DIM": HEAD_DIM, "DOT_DTYPE": DOT_DTYPES[dtype],
        "FAST_PREFILL": sched.fast_prefill, "MATRIX_SUM": canonical, "PROMPT": sched.prompt, "STAGES": stages,
        "INTERPRET": False,
    }
    kernel = attention._attention_kernel
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
        elif values.get(name, 0) is None:
            signature[name], constexprs[(i,)] = "constexpr", None
        elif name.endswith("_ptr") and name not in values:
            signature[name] = "*i32"
        else:
            signature[name] = mangle_type(values.get(name, 7))
    return _lowered_shared(ASTSource(kernel, signature, constexprs), {"num_warps": sched.num_warps, "num_stages": stages})


def _lowered_shared(src: ASTSource, options: dict[str, int]) -> int:
    """``triton.compile``'s stages for sm_90 up to LLVM IR; the shared bytes it allocated."""
    backend = make_backend(SM90)
    parsed = backend.parse_options(options)
    stages: dict[str, object] = {}
    backend.add_stages(stages, parsed, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(SM90, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context)
    metadata = {"target": SM90, **parsed.__dict__}
    for ext, lower in stages.items():
        module = lower(module, metadata)
        if ext == "llir":
            return metadata["shared"]
    raise RuntimeError("no LLVM IR stage for sm_90")


def main() -> None:
    attention._has_tma = lambda device: True  # as on sm_90: the fast prompt launch takes descriptors
    group = HEADS // KV_HEADS
    launch = (4096, 8, KV_HEADS, 512, 4096, torch.device("cpu"))  # 8 sequences of 512 prompt rows
    schedules = {
        "canonical prompt": (attention._canonical_schedule(group, *launch), True),
        "fast prompt": (attention._fast_schedule(4096, 8, group, *launch[2:]), False),
    }
    found = {
        f"{name} {str(dtype).removeprefix('torch.')}": shared_bytes(sched, dtype, canonical)
        for name, (sched, canonical) in schedules.items()
        for dtype in (torch.float32, torch.bfloat16)
    }
    print(json.dumps(found))


if __name__ == "__main__":
    main()
