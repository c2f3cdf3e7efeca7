"""What sending each step's plan to the tensor-parallel workers costs.

Two ranks on this machine (gloo control group, as in the engine). Rank 0 sends a plan
through ``ControlChannel.send_step`` and rank 1 receives and decodes it; both then do a
one-element all-reduce so rank 0 knows rank 1 has the plan. The same all-reduce alone
is the baseline, so ``plan_us`` is what the plan adds to a step: packing, two
broadcasts, unpacking. Shapes: decode steps of 1/32/256 sequences with 1024-token
contexts, a 2048-token prefill, and a canonical pass of 128 rows.

    python benchmarks/tp_plan.py [--iters 500]
    python benchmarks/tp_plan.py --smoke        # a few iterations
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_args, table, write_json  # noqa: E402

from sid.runtime.distributed import STOP, ControlChannel, init_groups  # noqa: E402
from sid.runtime.model_runner import StepInputs  # noqa: E402

BLOCK = 16


def step(seqs: int, rows_per_seq: int, context: int, canonical: bool = False) -> StepInputs:
    n = seqs * rows_per_seq
    blocks = context // BLOCK
    return StepInputs(
        input_ids=list(range(n)),
        positions=[context - rows_per_seq + k for _ in range(seqs) for k in range(rows_per_seq)],
        slots=list(range(n)),
        block_tables=np.arange(seqs * blocks, dtype=np.int32).reshape(seqs, blocks),
        seq_lens=[context] * seqs,
        query_start_loc=[s * rows_per_seq for s in range(seqs + 1)],
        canonical=canonical,
        logit_rows=None if canonical else [(s + 1) * rows_per_seq - 1 for s in range(seqs)],
    )


SHAPES = {
    "decode, 1 seq": step(1, 1, 1024),
    "decode, 32 seqs": step(32, 1, 1024),
    "decode, 256 seqs": step(256, 1, 1024),
    "prefill, 4 x 512 tokens": step(4, 512, 512),
    "canonical, 128 rows": step(4, 32, 1024, canonical=True),
}


def ack() -> None:
    dist.all_reduce(torch.zeros(1))


def worker(rank: int, port: int, iters: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    control = ControlChannel(init_groups(store, rank, 2, torch.device("cpu")))
    for _ in range(iters):
        ack()
    while True:
        kind, _ = control.recv()
        if kind == STOP:
            break
        ack()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=500)
    args = parse_args(ap, smoke=dict(iters=5))
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    proc = mp.get_context("spawn").Process(target=worker, args=(1, store.port, args.iters))
    proc.start()
    control = ControlChannel(init_groups(store, 0, 2, torch.device("cpu")))
    start = time.perf_counter()
    for _ in range(args.iters):
        ack()
    base = (time.perf_counter() - start) / args.iters
    rows = []
    for name, plan in SHAPES.items():
        for _ in range(min(20, args.iters)):  # warm-up
            control.send_step(plan)
            ack()
        start = time.perf_counter()
        for _ in range(args.iters):
            control.send_step(plan)
            ack()
        per = (time.perf_counter() - start) / args.iters
        ints = 3 * len(plan.input_ids) + sum(map(len, plan.block_tables)) + 2 * len(plan.seq_lens) + 1
        rows.append({"plan": name, "rows": len(plan.input_ids), "ints": ints, "plan_us": 1e6 * (per - base)})
    control.send(STOP)
    proc.join()
    dist.destroy_process_group()
    out = write_json("tp_plan", {"iters": args.iters, "all_reduce_us": 1e6 * base, "rows": rows}, args.out)
    print(f"all-reduce round trip alone: {1e6 * base:.0f} us")
    print(table(rows, ["plan", "rows", "ints", "plan_us"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
