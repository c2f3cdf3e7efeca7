"""Decode step time (CUDA graph) against the memory-bandwidth floor.

For each batch x context, the engine's own decode graph for that batch replays a step in
which every row sits at the given context. The floor is (weight bytes + K/V bytes read) /
bandwidth, counting the weights a step reads: an untied embedding table gives a step one row
per token, not the whole table (Llama-3.1-8B: 1.05 GB of its 16.1, left out since the
twenty-third session), with the bandwidth measured in the same run by reading a large bf16 tensor.
Combinations whose K/V does not fit in the engine's pool are reported as skipped.
``--kernels`` adds where a step's time goes: each kind of kernel's time per step under
``torch.profiler`` (graph replays included), and the step time the kernels leave idle.
On the CPU (``--smoke``) there are no CUDA graphs: the same static buffers and ``load``
feed the graph's computation, which ``replay`` runs eagerly when nothing was captured.

    python benchmarks/decode_roofline.py --model llama-3.1-8b [--kernels]     # H200
    python benchmarks/decode_roofline.py --smoke                   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PRESETS, SMOKE_MODEL, bench_device, device_name, device_time, engine_device, model_dir, parse_args, table,
    write_json,
)

from sid import LLM  # noqa: E402
from sid.engine.kv_cache import cdiv  # noqa: E402
from sid.engine.memory import block_bytes  # noqa: E402
from sid.runtime.cuda_graphs import CUDAGraphs  # noqa: E402


def read_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second of a ``sum`` over a large bf16 tensor (median of 20)."""
    x = torch.randn(int(gib * 2**30 / 2), dtype=torch.bfloat16, device=device)
    return x.numel() * 2 / device_time(x.sum, device)


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: all but an untied embedding table, of which
    it reads a row per token (negligible); a tied one is read whole by the LM head."""
    lookup_only = getattr(model, "lm_head", None) is not None
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not (lookup_only and name == "embed_tokens.weight"))


def kernel_breakdown(fn: Callable[[], object], device: torch.device, steps: int = 10) -> dict[str, dict[str, float]]:
    """Microseconds and launches per step of each kind of kernel (names cut at their first digit or bracket,
    so one Triton kernel's specialisations or one cuBLAS family count together) over ``steps``
    calls of ``fn``; on the CPU, the profiler's operator times."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    fn()
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device == (device.type == "cuda"):
            kind = totals[re.split(r"[0-9<(\[]", event.name, maxsplit=1)[0][:60]]
            kind[0] += event.self_device_time_total if on_device else event.self_cpu_time_total
            kind[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {name: {"us": us / steps, "calls": calls / steps} for name, (us, calls) in ranked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--kernels", action="store_true", help="also each kind of kernel's time per step")
    ap.add_argument("--bandwidth-gib", type=float, default=4.0, help="size of the tensor the bandwidth is read from")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, batches="1,4", contexts="32,64", bandwidth_gib=0.0625,
                                     kernels=True))
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model_dir(args.model), load_format="dummy" if args.model in PRESETS else "auto",
              device=engine_device(args),
              max_model_len=max(contexts) + 1, max_num_seqs=max(batches), enable_determinism=False)
    engine = llm.llm_engine
    device = bench_device(args)
    graphs = engine.runner.graphs
    if graphs is None:
        assert device.type != "cuda", "decode_roofline needs CUDA graphs on a GPU (enforce_eager=False)"
        max_blocks = cdiv(engine.max_model_len, engine.config.block_size)
        graphs = CUDAGraphs(engine.model, engine.kv_cache, max_batch=max(batches), max_blocks=max_blocks,
                            max_seq_len=engine.max_model_len)
    cache = engine.kv_cache
    for t in cache.k + cache.v:
        t.normal_()  # never time on zeros
    bw = read_bandwidth(device, args.bandwidth_gib)
    weight_bytes = step_weight_bytes(engine.model)
    kv_token_bytes = block_bytes(engine) // engine.config.block_size
    bs, pool = engine.config.block_size, engine.kv.pool.num_blocks
    rows = []
    for ctx in contexts:
        for b in batches:
            per_seq = cdiv(ctx, bs)
            if b * per_seq > pool:
                rows.append({"batch": b, "context": ctx, "status": "skipped: K/V does not fit"})
                continue
            tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
            slots = tables[:, (ctx - 1) // bs].astype(np.int64) * bs + (ctx - 1) % bs
            bucket = graphs.load([1] * b, [ctx - 1] * b, slots, tables, [ctx] * b)
            seconds = device_time(lambda: graphs.replay(bucket), device, iters=30)
            floor = (weight_bytes + b * ctx * kv_token_bytes) / bw
            row = {"batch": b, "context": ctx, "step_ms": seconds * 1e3, "floor_ms": floor * 1e3,
                   "of_floor": floor / seconds, "tok_s": b / seconds, "status": "ok"}
            if args.kernels:
                row["kernels_us"] = kernel_breakdown(lambda: graphs.replay(bucket), device)
            rows.append(row)
    meta = {"model": args.model, "gpu": device_name(device), "cuda_graphs": graphs.captured,
            "bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes / 1e9, "kv_bytes_per_token": kv_token_bytes}
    out = write_json("decode_roofline", {**meta, "rows": rows}, args.out)
    print(f"{args.model} on {meta['gpu']}: read bandwidth {bw / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.1f} GB")
    print(table(rows, ["batch", "context", "step_ms", "floor_ms", "of_floor", "tok_s", "status"]))
    for row in rows:
        if "kernels_us" in row:
            kernels = row["kernels_us"]
            busy = sum(k["us"] for k in kernels.values())
            calls = sum(k["calls"] for k in kernels.values())
            idle = row["step_ms"] * 1e3 - busy
            where = f"batch {row['batch']} x {row['context']}"
            print(f"{where}: {calls:.0f} kernels, {busy:.0f} us a step, idle {idle:.0f}")
            print(table([{"kernel": k, **v} for k, v in list(kernels.items())[:12]], ["kernel", "us", "calls"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
