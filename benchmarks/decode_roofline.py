"""Decode step time (CUDA graph) against the memory-bandwidth floor.

For each batch x context, the engine's own decode graph for that batch replays a step in
which every row sits at the given context. The floor is (weight bytes + K/V bytes read) /
bandwidth, with the bandwidth measured in the same run by reading a large bf16 tensor.
Combinations whose K/V does not fit in the engine's pool are reported as skipped.

    python benchmarks/decode_roofline.py --model llama-3.1-8b      # H200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, cuda_time, model_dir, table, write_json  # noqa: E402

from sid import LLM  # noqa: E402
from sid.engine.kv_cache import cdiv  # noqa: E402


def read_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of a ``sum`` over a large bf16 tensor (median of 20)."""
    x = torch.randn(int(gib * 2**30 / 2), dtype=torch.bfloat16, device="cuda")
    return x.numel() * 2 / cuda_time(x.sum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model_dir(args.model), load_format="dummy" if args.model in PRESETS else "auto",
              max_model_len=max(contexts) + 1, max_num_seqs=max(batches), enable_determinism=False)
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None, "decode_roofline needs CUDA graphs (a GPU and enforce_eager=False)"
    cache = engine.kv_cache
    for t in cache.k + cache.v:
        t.normal_()  # never time on zeros
    bw = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_token_bytes = engine._block_bytes() // engine.config.block_size
    bs, pool = engine.config.block_size, engine.kv.pool.num_blocks
    rows = []
    for ctx in contexts:
        for b in batches:
            per_seq = cdiv(ctx, bs)
            if b * per_seq > pool:
                rows.append({"batch": b, "context": ctx, "status": "skipped: K/V does not fit"})
                continue
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            slots = [t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t in tables]
            bucket = graphs.load([1] * b, [ctx - 1] * b, slots, tables, [ctx] * b)
            seconds = cuda_time(lambda: graphs.replay(bucket), iters=30)
            floor = (weight_bytes + b * ctx * kv_token_bytes) / bw
            rows.append({"batch": b, "context": ctx, "step_ms": seconds * 1e3, "floor_ms": floor * 1e3,
                         "of_floor": floor / seconds, "tok_s": b / seconds, "status": "ok"})
    meta = {"model": args.model, "gpu": torch.cuda.get_device_name(), "bandwidth_TBps": bw / 1e12,
            "weight_GB": weight_bytes / 1e9, "kv_bytes_per_token": kv_token_bytes}
    out = write_json("decode_roofline", {**meta, "rows": rows}, args.out)
    print(f"{args.model} on {meta['gpu']}: read bandwidth {bw / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.1f} GB")
    print(table(rows, ["batch", "context", "step_ms", "floor_ms", "of_floor", "tok_s", "status"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
