"""Prefill against the matmul rate: the model's GEMMs at a prefill step's size, and the whole step.

The bf16 matmul rate is measured in the same run (an 8192^3 ``torch.mm``). Each linear layer of
one decoder layer is then timed at ``--tokens`` rows (the scheduler's token budget), and a
whole prefill step (``--tokens`` rows as ``--seqs`` fresh prompts, eager, as the engine runs
it) is timed end to end; its rate counts the linear layers' FLOPs (2 x params x tokens)
plus causal attention's (2 x 2 x tokens x context / 2 x heads x head_dim per layer).
The same step is then timed as a deterministic prompt runs it: canonical passes of at most
the largest canonical size, and, to tell the pass split from the canonical numerics, fast
passes of those sizes; the heaviest kernels of the canonical step are listed.

    python benchmarks/prefill.py --model llama-3.1-8b      # H200
    python benchmarks/prefill.py --smoke                   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PRESETS, SMOKE_MODEL, bench_device, device_name, device_time, engine_device, model_dir, parse_args, table,
    write_json,
)

from sid import LLM, SamplingParams  # noqa: E402
from sid.engine.request import Request  # noqa: E402
from sid.engine.plan import ScheduledChunk  # noqa: E402


def matmul_rate(n: int, device: torch.device) -> float:
    """FLOP/s of a bf16 ``n``^3 matmul, measured now (these machines vary)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / device_time(lambda: a @ a, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--matmul-n", type=int, default=8192, help="size of the square matmul the peak rate is read from")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, tokens=64, seqs=2, matmul_n=256))
    device = bench_device(args)
    peak = matmul_rate(args.matmul_n, device)
    llm = LLM(model_dir(args.model), load_format="dummy" if args.model in PRESETS else "auto",
              device=engine_device(args),
              max_model_len=args.tokens + 16, max_num_batched_tokens=args.tokens)
    engine = llm.llm_engine
    model = engine.model
    layer = model.layers[0]
    rows = []
    linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    gemm_seconds = gemm_flops = 0.0
    for name, lin in linears.items():
        inp = torch.randn(args.tokens, lin.in_features, dtype=engine.dtype, device=device)
        seconds = device_time(lambda lin=lin, inp=inp: lin(inp), device)
        flops = 2 * args.tokens * lin.in_features * lin.out_features
        gemm_seconds += seconds
        gemm_flops += flops
        rows.append({"op": name, "shape": f"{args.tokens}x{lin.in_features}->{lin.out_features}",
                     "ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12, "of_matmul_peak": flops / seconds / peak})
    rows.append({"op": "one layer's GEMMs", "ms": gemm_seconds * 1e3, "TFLOPs": gemm_flops / gemm_seconds / 1e12,
                 "of_matmul_peak": gemm_flops / gemm_seconds / peak})

    per_seq = args.tokens // args.seqs
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    chunks = []
    for s in range(args.seqs):
        r = Request(f"prefill-{s}", None, list(range(1, per_seq + 1)), params, 0, 1, frozenset(), 0)
        assert engine.kv.allocate(r, per_seq)
        chunks.append(ScheduledChunk(r, 0, per_seq))
    tables = engine.kv.block_table([c.request for c in chunks])
    seconds = device_time(lambda: engine.runner.execute(chunks, tables), device, iters=10)
    cfg = engine.model_config
    linear_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    attn_flops = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * args.seqs * per_seq * per_seq  # causal: half of 4
    step_flops = 2 * linear_params * args.tokens + attn_flops
    rows.append({"op": f"prefill step ({args.seqs} x {per_seq})", "ms": seconds * 1e3,
                 "TFLOPs": step_flops / seconds / 1e12, "of_matmul_peak": step_flops / seconds / peak})
    packs = engine.scheduler.windowed.pack(chunks)
    pack_tables = [engine.kv.block_table([c.request for c in p]) for p in packs]

    def split(canonical: bool) -> None:
        for p, t in zip(packs, pack_tables):
            engine.runner.execute(p, t, canonical=canonical)

    sizes = "+".join(str(engine.canonical.fit(sum(c.num_tokens for c in p))) for p in packs)
    for name, canonical in ((f"fast passes of {sizes} rows", False), (f"canonical passes of {sizes} rows", True)):
        seconds = device_time(lambda canonical=canonical: split(canonical), device, iters=10)
        rows.append({"op": name, "ms": seconds * 1e3, "TFLOPs": step_flops / seconds / 1e12,
                     "of_matmul_peak": step_flops / seconds / peak})
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        split(True)
        if cuda:
            torch.cuda.synchronize()
    kernels = prof.key_averages().table(sort_by=f"{device.type}_time_total", row_limit=8, max_name_column_width=60)
    meta = {"model": args.model, "gpu": device_name(device), "matmul_TFLOPs": peak / 1e12}
    out = write_json(f"prefill_{Path(args.model).name}", {**meta, "rows": rows}, args.out)
    print(kernels)
    print(f"{args.model} on {meta['gpu']}: bf16 matmul {peak / 1e12:.0f} TFLOP/s ({args.matmul_n}^3, this run)")
    print(table(rows, ["op", "shape", "ms", "TFLOPs", "of_matmul_peak"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
