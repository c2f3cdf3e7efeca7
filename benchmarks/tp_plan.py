"""What sending each step's plan to the tensor-parallel workers costs.

Two ranks on this machine, as in the engine: rank 0 writes plans with
``ControlChannel.send_step`` into the worker's pipe, rank 1 reads and decodes them
(``ControlReceiver``); both then do a one-element gloo all-reduce so rank 0 knows rank 1
has the plan. Medians over ``--iters`` steps per shape: ``send_us``, rank 0's time in
``send_step``; ``arrive_us``, from rank 0 starting to send until rank 1 holds the decoded
plan (one monotonic clock for both processes); ``plan_us``, a plan and the all-reduce
minus the all-reduce alone, what the plan adds to a step. ``sent_ints`` is the mean
message size (block tables go as patches), ``full_ints`` what the whole plan holds.

Each shape is a cycle of successive steps, as an engine sends them: decode steps of
1/32/256 sequences at staggered ~1024-token contexts (each sequence takes a new block every
16 tokens; one sequence is replaced every 16 steps), 2048-token prefill steps of 4 new
requests each, and canonical passes of 4 sequences x 32 rows.

    python benchmarks/tp_plan.py [--iters 500]
    python benchmarks/tp_plan.py --smoke        # a few iterations
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_args, table, write_json  # noqa: E402

from sid.runtime.distributed import COLLECTIVE_TIMEOUT, STOP, ControlChannel, ControlReceiver, init_group  # noqa: E402
from sid.runtime.model_runner import StepInputs  # noqa: E402

BLOCK = 16
CYCLE = 64
"""Distinct successive steps per shape, replayed in a loop."""


def trace(
    seqs: int, rows_per_seq: int, context: int, churn: int, fresh: bool = False, canonical: bool = False
) -> list[StepInputs]:
    """``CYCLE`` successive steps: sequence ``i`` at ``context + i + t * rows_per_seq`` tokens
    at step ``t``, its blocks allocated as it grows; every ``churn`` steps one sequence is
    replaced by a new one (``fresh``: every sequence is new at every step, as in prefill)."""
    next_block, next_key = 0, 0
    blocks: dict[int, list[int]] = {}
    keys, starts = list(range(seqs)), [context + i for i in range(seqs)]
    steps = []
    for t in range(CYCLE):
        if fresh or (churn and t and t % churn == 0):
            for i in range(seqs) if fresh else [(t // churn) % seqs]:
                next_key += 1
                keys[i], starts[i] = seqs + next_key, context + i - t * rows_per_seq
        lens = [starts[i] + (t + 1) * rows_per_seq for i in range(seqs)]
        for key, n in zip(keys, lens):
            owned = blocks.setdefault(key, [])
            while len(owned) * BLOCK < n:
                owned.append(next_block)
                next_block += 1
        width = max(len(blocks[k]) for k in keys)
        tables = np.zeros((seqs, width), dtype=np.int32)
        for i, key in enumerate(keys):
            tables[i, : len(blocks[key])] = blocks[key]
        positions = [n - rows_per_seq + k for n in lens for k in range(rows_per_seq)]
        seq = np.repeat(np.arange(seqs), rows_per_seq)
        pos = np.array(positions)
        rows = seqs * rows_per_seq
        steps.append(
            StepInputs(
                input_ids=list(range(rows)),
                positions=positions,
                slots=(tables[seq, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK),
                block_tables=tables,
                seq_lens=lens,
                query_start_loc=[s * rows_per_seq for s in range(seqs + 1)],
                canonical=canonical,
                logit_rows=[(s + 1) * rows_per_seq - 1 for s in range(seqs)],
                seq_keys=list(keys),
            )
        )
    return steps


SHAPES = {
    "decode, 1 seq": lambda: trace(1, 1, 1024, churn=0),
    "decode, 32 seqs": lambda: trace(32, 1, 1024, churn=16),
    "decode, 256 seqs": lambda: trace(256, 1, 1024, churn=16),
    "prefill, 4 x 512 tokens": lambda: trace(4, 512, 0, churn=0, fresh=True),
    "canonical, 4 x 32 rows": lambda: trace(4, 32, 1024, churn=0, canonical=True),
}


def full_ints(plan: StepInputs) -> int:
    """What the whole plan holds: rows' ids, positions, slots; tables; lengths and starts."""
    return 3 * len(plan.input_ids) + plan.block_tables.size + 2 * len(plan.seq_lens) + 1 + len(plan.logit_rows or ())


def ack(sent_at: float = 0.0) -> float:
    """A one-element all-reduce: rank 0's ``sent_at`` reaches rank 1 (it adds 0.0)."""
    x = torch.tensor([sent_at], dtype=torch.float64)
    dist.all_reduce(x)
    return float(x.item())


def worker(port: int, fd: int, iters: int) -> None:
    """Rank 1: the baseline all-reduces, then per shape ``iters`` plans, each followed by an
    all-reduce that brings rank 0's send time; the median delay from that time to a decoded
    plan goes back through the store."""
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    init_group(store, 1, 2, torch.device("cpu"), COLLECTIVE_TIMEOUT)
    control = ControlReceiver(fd)
    for _ in range(iters):
        ack()
    delays: list[float] = []
    while True:
        kind, _ = control.recv()
        if kind == STOP:
            break
        decoded = time.perf_counter()  # CLOCK_MONOTONIC: one clock for both processes
        delays.append(decoded - ack())
        if len(delays) == iters:
            store.set(f"arrive/{store.add('shape', 1)}", str(statistics.median(delays)))
            delays = []
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=500)
    args = parse_args(ap, smoke=dict(iters=5))
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    read, write = os.pipe()
    here = str(Path(__file__).resolve().parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); "
            f"from tp_plan import worker; worker({store.port}, {read}, {args.iters})")
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(read,))
    os.close(read)
    init_group(store, 0, 2, torch.device("cpu"), COLLECTIVE_TIMEOUT)
    control = ControlChannel([write])
    alone = []
    for _ in range(args.iters):
        start = time.perf_counter()
        ack()
        alone.append(time.perf_counter() - start)
    base = statistics.median(alone)
    rows = []
    for shape, (name, make) in enumerate(SHAPES.items(), start=1):
        plans = make()
        sent, send_s, step_s = control.ints_sent, [], []
        for i in range(args.iters):
            start = time.perf_counter()
            control.send_step(plans[i % CYCLE])
            send_s.append(time.perf_counter() - start)
            ack(start)
            step_s.append(time.perf_counter() - start)
        rows.append(
            {
                "plan": name,
                "rows": len(plans[0].input_ids),
                "full_ints": round(sum(map(full_ints, plans)) / CYCLE),
                "sent_ints": round((control.ints_sent - sent) / args.iters),
                "send_us": 1e6 * statistics.median(send_s),
                "arrive_us": 1e6 * float(store.get(f"arrive/{shape}")),
                "plan_us": 1e6 * (statistics.median(step_s) - base),
            }
        )
    control.send(STOP)
    control.close()
    proc.wait()
    dist.destroy_process_group()
    out = write_json("tp_plan", {"iters": args.iters, "all_reduce_us": 1e6 * base, "rows": rows}, args.out)
    print(f"all-reduce round trip alone (median): {1e6 * base:.0f} us")
    print(table(rows, ["plan", "rows", "full_ints", "sent_ints", "send_us", "arrive_us", "plan_us"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
