"""Do the GEMMs of a model give a row the same bits whatever the pass size M?

DESIGN 1 checks row independence at one fixed M. If it also held *across* M (a row's bits
the same in a pass of 128 rows and one of 4,096), canonical prompts could run in large
passes instead of many ``M_canon``-row ones. This measures it for every GEMM shape of a
model (``F.linear``, bf16, as the decoder runs them): each row computed in passes of
``--base`` rows is the reference; passes of other sizes hold a shuffled subset of the same
rows, so slots differ too. Also times each size (one GEMM replayed from a CUDA graph; on the
CPU, run directly).

    python benchmarks/pass_invariance.py --model llama-3.1-8b --model qwen3-0.6b   # H200
    python benchmarks/pass_invariance.py --smoke                                   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GPU_PRESETS, PRESETS, SMOKE_MODEL, bench_device, device_name, device_time, parse_args, replayable, table,
    write_json,
)

SIZES = (128, 192, 256, 384, 512, 1000, 1024, 2048, 4096)


def gemm_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) features of each GEMM of one decoder layer, and of the LM head."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (cfg["vocab_size"], hidden),
    }


def check(out_f: int, in_f: int, base: int, sizes: list[int], rows: int, dev: torch.device) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(out_f, in_f, device=dev, generator=gen).mul_(0.02).to(torch.bfloat16)
    x = torch.randn(rows, in_f, device=dev, generator=gen).to(torch.bfloat16)
    ref = torch.cat([F.linear(x[i : i + base], w) for i in range(0, rows, base)])
    results = []
    for m in sizes:
        mismatched = 0
        for trial in range(3):
            idx = torch.randperm(rows, device=dev, generator=gen)[:m]
            got = F.linear(x[idx], w)
            mismatched += int((got != ref[idx]).any(dim=1).sum())
        xm = x[:m].contiguous()
        ms = device_time(replayable(lambda: F.linear(xm, w), dev), dev) * 1e3
        results.append(
            {"M": m, "mismatched_rows": mismatched, "checked_rows": 3 * m, "ms": ms, "us_per_row": 1e3 * ms / m}
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=list(PRESETS), help="repeatable; default: the real models")
    ap.add_argument("--base", type=int, default=128, help="the reference pass size (M_canon)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None, help="torch's preferred BLAS library")
    args = parse_args(ap, smoke=dict(model=[SMOKE_MODEL], base=4, sizes="4,8,16"))
    device = bench_device(args)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("pass_invariance measures cuBLAS: it needs a CUDA device (--smoke runs on the CPU)")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows_total = max(sizes) * 2
    report: dict = {"gpu": device_name(device), "torch": torch.__version__, "base": args.base,
                    "blas": str(torch.backends.cuda.preferred_blas_library()),
                    "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")},
                    "results": []}
    lines = []
    for name in args.model or GPU_PRESETS:
        for gemm, (out_f, in_f) in gemm_shapes(PRESETS[name]).items():
            for r in check(out_f, in_f, args.base, sizes, rows_total, device):
                r = {"model": name, "gemm": f"{gemm} {in_f}->{out_f}", **r}
                report["results"].append(r)
                lines.append(r)
                print(f"{name} {gemm} M={r['M']}: {r['mismatched_rows']}/{r['checked_rows']} rows differ, "
                      f"{r['ms']:.3f} ms", flush=True)
    write_json("pass_invariance", report, args.out)
    print(table(lines, ["model", "gemm", "M", "mismatched_rows", "checked_rows", "ms", "us_per_row"]))


if __name__ == "__main__":
    main()
