"""What one forward pass of each kind costs, timed the ways the scheduler's cost model could use.

The engine times its passes at start-up (``sid.engine.calibrate``) with decode rows at a
mid-length context, as the best of a lone pass and of passes queued back to back. This
benchmark times the same passes with decode rows at position 0 and/or lone passes only,
waited for, so the difference those two choices make is visible: a launch-bound model
pays host time per pass, which queued passes hide behind the GPU, and attention is a
share of a long-context step.

    python benchmarks/pass_costs.py --model qwen3-0.6b      # H200, dummy weights
    python benchmarks/pass_costs.py --smoke                 # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, SMOKE_MODEL, engine_device, model_dir, parse_args, table, write_json  # noqa: E402

from sid import LLM  # noqa: E402
from sid.engine.calibrate import measure_pass_costs  # noqa: E402

TABLES = ("fast_graphed", "fast_eager", "canonical_graphed", "canonical_eager")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint path or preset (llama-3.1-8b, qwen3-0.6b)")
    ap.add_argument("--max-model-len", type=int, default=2064)
    ap.add_argument("--context", type=int, default=1024, help="keys each decode row reads, in the timings at context")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, max_model_len=256, context=64))
    llm = LLM(
        model_dir(args.model) if args.model else None,
        load_format="dummy" if args.model in PRESETS else "auto",
        device=engine_device(args),
        max_model_len=args.max_model_len,
        determinism_strategy="speculate",  # the windowed lane, whose canonical passes it times
    )
    engine = llm.llm_engine
    sched = engine.scheduler.windowed
    variants = {
        "engine (at context)": (args.context, 4),
        "position 0": (0, 4),
        "lone, at context": (args.context, 1),
        "lone, position 0": (0, 1),
    }
    timed = {}
    for name, (context, launches) in variants.items():
        cost = measure_pass_costs(
            engine.runner,
            engine.kv,
            engine.canonical_domain,
            fast_graph_rows=sched.fast_graph_rows,
            graph_rows=sched.graph_rows,
            max_rows=engine.config.max_num_batched_tokens,
            chunk_len=min(1024, engine.max_model_len - 1),
            context=context,
            launches=launches,
        )
        if cost is None:
            raise SystemExit("the KV pool cannot hold the passes to time")
        timed[name] = {kind: dict(getattr(cost, kind)) for kind in TABLES}
    first = next(iter(timed.values()))
    rows = [
        {"pass": kind, "rows": r, **{name: timed[name][kind][r] for name in variants}}
        for kind in TABLES
        for r in first[kind]
    ]
    path = write_json("pass_costs", {"model": args.model or engine.config.model, "device": str(engine.device),
                                     "context": args.context, "rows": rows}, args.out)
    print(f"{args.model or 'built-in model'} on {engine.device}: ms per pass (decode rows at {args.context} keys "
          "or at position 0; best of lone and 4-deep queued passes, or lone passes only)")
    print(table(rows, ["pass", "rows", *variants]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
