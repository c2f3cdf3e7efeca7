"""Which GEMM path keeps a row's bits at every row count, per weight shape, and what it costs.

For every GEMM shape of real models (Llama-3.1-8B, Qwen3-0.6B, Qwen2.5-7B, the TP=2 shards
of Llama-3.1-8B and the TP=4/TP=8 shards of Llama-3.1-70B, LM heads included) each candidate
path of ``sid.runtime.gemm`` is put through the engine's own proof (``prove``: every pass
size the engine uses, 1 to 4,096 rows, and shuffled slots) and timed at the decode buckets
and two prompt sizes (one GEMM replayed from a CUDA graph, random bf16 data). The table
shows, per shape and path, whether the proof holds and the time at each size; ``ratio`` is
the proven path the engine would take over the fast path (cuBLASLt) at each size.

    python benchmarks/gemm_paths.py --out results/        # H200
    python benchmarks/gemm_paths.py --smoke               # CPU: the trained model's shapes, up to 64 rows
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_device, parse_args, table, write_json  # noqa: E402

from sid.engine.plan import PassSizes  # noqa: E402
from sid.runtime.gemm import CPU_TILE, GemmPath, candidates, fast_path, prove, run, time_gemm  # noqa: E402

TIMED = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tp: int = 1,
           bias: bool = False) -> dict[str, tuple[int, int, bool]]:
    """(out, in, bias) of a decoder layer's GEMMs and its LM head at one TP rank."""
    q, kv = heads * head_dim // tp, max(1, kv_heads // tp) * head_dim
    return {
        "qkv": (q + 2 * kv, hidden, bias),
        "o": (hidden, q, False),
        "gate_up": (2 * inter // tp, hidden, False),
        "down": (hidden, inter // tp, False),
        "lm_head": (-(-vocab // tp), hidden, False),
    }


MODELS = {
    "llama-3.1-8b": shapes(4096, 14336, 32, 8, 128, 128256),
    "qwen3-0.6b": shapes(1024, 3072, 16, 8, 128, 151936),
    "qwen2.5-7b": shapes(3584, 18944, 28, 4, 128, 152064, bias=True),
    "llama-3.1-8b/tp2": shapes(4096, 14336, 32, 8, 128, 128256, tp=2),
    "llama-3.1-70b/tp4": shapes(8192, 28672, 64, 8, 128, 128256, tp=4),
    "llama-3.1-70b/tp8": shapes(8192, 28672, 64, 8, 128, 128256, tp=8),
}
SMOKE = {"tiny-pycode-llama": shapes(384, 1024, 6, 2, 64, 8192)}


def timed(path: GemmPath, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, m: int) -> float:
    """Microseconds of one GEMM of ``m`` rows: on a GPU from a CUDA graph of 16 of them on one
    weight (``time_gemm``)."""
    xm = x[:m].contiguous()
    if x.is_cuda:
        return time_gemm(path, xm, [(w, b)])
    start = time.perf_counter()
    run(path, xm, w, b)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-rows", type=int, default=4096)
    args = parse_args(ap, smoke=dict(max_rows=64))
    device = bench_device(args)
    cuda = device.type == "cuda"
    largest = args.max_rows
    sizes = list(PassSizes.grid(1, largest, 16 if cuda else 8, cover=True).sizes)
    timed_sizes = [m for m in TIMED if m <= largest]
    fast = fast_path(device)
    report: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "env": {
            k: os.environ.get(k)
            for k in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "CUBLASLT_WORKSPACE_SIZE")
        },
        "proof_sizes": len(sizes),
        "results": [],
    }
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for model, gemms in (SMOKE if args.smoke else MODELS).items():
        for name, (out_f, in_f, has_bias) in gemms.items():
            w = (torch.randn(out_f, in_f, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            b = torch.randn(out_f, generator=gen, device=device).to(torch.bfloat16) if has_bias else None
            x = torch.randn(largest, in_f, generator=gen, device=device).to(torch.bfloat16)
            times = {}
            proven = None
            for path in candidates(device, CPU_TILE):
                broken = prove(path, w, b, sizes)
                us = {m: timed(path, x, w, b, m) for m in timed_sizes}
                times[str(path)] = us
                proven = proven or (path if broken is None else None)
                row = {"model": model, "gemm": f"{name} {in_f}->{out_f}", "path": str(path),
                       "invariant": "yes" if broken is None else broken, **{f"us@{m}": us[m] for m in timed_sizes}}
                report["results"].append(row)
                rows.append(row)
            if proven is not None:
                ratio = {f"us@{m}": times[str(proven)][m] / times[str(fast)][m] for m in timed_sizes}
                rows.append({"model": model, "gemm": f"{name} {in_f}->{out_f}", "path": f"ratio {proven}/{fast}",
                             "invariant": "", **ratio})
            print(f"{model} {name}: proven path {proven}", flush=True)
    write_json("gemm_paths", report, args.out)
    print(table(rows, ["model", "gemm", "path", "invariant", *(f"us@{m}" for m in timed_sizes)]))


if __name__ == "__main__":
    main()
