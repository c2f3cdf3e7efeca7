"""Sweep the canonical attention schedule's launch constants on the canonical lane's own shapes.

A canonical pass is ``canonical_rows`` (128) query rows: in a deterministic prompt, a
128-token chunk attending to its prefix; in a whole canonical step, 128 decoding
sequences. Both run from the canonical CUDA graph with ``max_seq_len`` = the model's limit.
Each candidate of ``CANONICAL_CONFIG`` (block_m, kv_tile, kv_split, num_warps) is timed on
those shapes for the Qwen3-0.6B (GQA 2) and Llama-3.1-8B (GQA 4) head layouts, against the
fast schedule on the same inputs, and its outputs are compared bit for bit with the
default's (``differ``: query rows x heads whose output changed; 0 means the constants could
change without changing a row's bits on this GPU). The best is checked for bit-identity
under batch changes (``attention.check_model``) and written as JSON for
``determinism_cost.py --canonical-config``. Changing the default changes the numerics
fingerprint.

    python benchmarks/canonical_sweep.py --out results/     # H200
    python benchmarks/canonical_sweep.py --smoke            # CPU interpreter, two candidates
"""

from __future__ import annotations

import argparse
import itertools
import json

import attention  # sets TRITON_INTERPRET on a CPU; it must come before triton
import torch
import triton
from common import parse_args, table, write_json

from sid.kernels import paged_attention as pa

PREFILL_OFFSETS = (0, 384, 896)
"""Where the 128-row prompt chunks start: a canonical prefill's passes see growing prefixes."""
DECODE_CONTEXT = 1024


def shapes(pool: attention.Pool, heads: int, rows: int, offsets: tuple[int, ...], context: int) -> dict[str, tuple]:
    """Kernel arguments of each timed shape: prompt chunks at ``offsets``, and a whole step of
    ``rows`` sequences of ``context`` keys."""
    dim, device = pool.k.shape[3], pool.device

    def queries(n: int) -> torch.Tensor:
        return torch.randn(n, heads, dim, dtype=attention.DTYPE, device=device)

    out = {}
    for offset in offsets:
        ctx = offset + rows
        out[f"prefill@{offset}"] = attention.batch_args(pool, [(pool.random_context(ctx), ctx, queries(rows))])
    out["decode"] = attention.batch_args(
        pool, [(pool.random_context(context), context, queries(1)) for _ in range(rows)]
    )
    return out


def attend(args: tuple, canonical: bool, max_seq_len: int, out: torch.Tensor) -> torch.Tensor:
    """One launch of the kernel on a shape's arguments, under the current ``CANONICAL_CONFIG``."""
    q = args[0]
    max_query_len = int((args[5][1:] - args[5][:-1]).max())
    return pa.paged_attention(*args, q.shape[-1] ** -0.5, canonical=canonical, out=out, max_query_len=max_query_len,
                              max_seq_len=max_seq_len)


def time_shape(args: tuple, canonical: bool, max_seq_len: int, smoke: bool) -> float:
    out = torch.empty_like(args[0])

    def run() -> None:
        attend(args, canonical, max_seq_len, out)

    ms = attention.bench_graph(run, smoke)
    return ms if ms is not None else attention.bench(run, smoke)


def canonical_out(args: tuple, max_seq_len: int) -> torch.Tensor:
    """The canonical schedule's output for one shape, in a NaN-poisoned buffer."""
    return attend(args, True, max_seq_len, torch.full_like(args[0], float("nan")))


def candidates(
    smoke: bool, block_ms: list[int], tiles: list[int], splits: list[int], warps: list[int]
) -> list[dict[str, int]]:
    if smoke:
        return [dict(pa.CANONICAL_CONFIG), {**pa.CANONICAL_CONFIG, "kv_split": 2 * pa.CANONICAL_CONFIG["kv_split"]}]
    grid = itertools.product(block_ms, tiles, splits, warps)
    base = pa.CANONICAL_CONFIG
    return [{**base, "block_m": m, "kv_tile": t, "kv_split": s, "num_warps": w} for m, t, s, w in grid if s % t == 0]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="canonical_rows")
    ap.add_argument("--max-seq-len", type=int, default=2064, help="the graph's key bound (model limit)")
    ap.add_argument("--decode-context", type=int, default=DECODE_CONTEXT, help="keys of each decoding sequence")
    ap.add_argument("--block-m", default="16,32,64", help="candidate block_m values")
    ap.add_argument("--kv-tile", default="64,128", help="candidate kv_tile values")
    ap.add_argument("--kv-split", default="256,512,1024", help="candidate kv_split values")
    ap.add_argument("--num-warps", default="4", help="candidate num_warps values")
    args = parse_args(ap, smoke=dict(rows=8, max_seq_len=96, decode_context=24))
    if args.smoke:
        pa.CANONICAL_CONFIG.update(attention.SMOKE_CONFIG)
    offsets = (0, 24) if args.smoke else PREFILL_OFFSETS
    context = args.decode_context
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    sizes = attention.SMOKE if args.smoke else attention.FULL
    default = dict(pa.CANONICAL_CONFIG)
    per_model = {}
    for name, (heads, kv_heads, head_dim) in sizes.models.items():
        blocks = (args.rows + 1) * triton.cdiv(context, attention.BLOCK_SIZE) + 2 * len(offsets) * args.max_seq_len
        pool = attention.Pool(blocks, kv_heads, head_dim, device)
        per_model[name] = shapes(pool, heads, args.rows, offsets, context)
    rows = []
    fast = {(m, s): time_shape(a, False, args.max_seq_len, args.smoke) for m, cases in per_model.items()
            for s, a in cases.items()}
    reference = {(m, s): canonical_out(a, args.max_seq_len) for m, cases in per_model.items() for s, a in cases.items()}
    for cfg in candidates(args.smoke, _ints(args.block_m), _ints(args.kv_tile), _ints(args.kv_split),
                          _ints(args.num_warps)):
        pa.CANONICAL_CONFIG.clear()
        pa.CANONICAL_CONFIG.update(cfg)
        row = {**cfg, "differ": 0}
        for (model, shape), fast_ms in fast.items():
            ms = time_shape(per_model[model][shape], True, args.max_seq_len, args.smoke)
            row[f"{model}:{shape}"] = ms / fast_ms  # canonical time over fast time, same inputs
            out = canonical_out(per_model[model][shape], args.max_seq_len)
            row["differ"] += int((out != reference[model, shape]).any(-1).sum())
        ratios = [v for k, v in row.items() if ":" in k]
        row["mean_ratio"] = sum(ratios) / len(ratios)
        row["worst_ratio"] = max(ratios)
        rows.append(row)
    rows.sort(key=lambda r: r["mean_ratio"])
    best = {k: rows[0][k] for k in default}
    pa.CANONICAL_CONFIG.clear()
    pa.CANONICAL_CONFIG.update(best)
    checks = {name: attention.check_model(sizes, *layout, device) for name, layout in sizes.models.items()}
    pa.CANONICAL_CONFIG.clear()
    pa.CANONICAL_CONFIG.update(default)
    current = next(r for r in rows if all(r[k] == v for k, v in default.items()))
    result = {"default": default, "best": best, "fast_ms": {f"{m}:{s}": v for (m, s), v in fast.items()},
              "rows": rows, "bit_identity_checks": checks}
    path = write_json("canonical_sweep", result, args.out)
    (path.parent / "canonical_best.json").write_text(json.dumps(best))
    cols = ["block_m", "kv_tile", "kv_split", "num_warps", *[k for k in rows[0] if ":" in k], "mean_ratio",
            "worst_ratio", "differ"]
    print(table(rows[:8] + ([current] if current not in rows[:8] else []), cols))
    print(f"canonical/fast time ratio; best {best} "
          f"(mean {rows[0]['mean_ratio']:.2f}, worst {rows[0]['worst_ratio']:.2f}) "
          f"vs default (mean {current['mean_ratio']:.2f}, worst {current['worst_ratio']:.2f}); wrote {path}")


if __name__ == "__main__":
    main()
