"""What a tensor-parallel all-reduce costs at decode sizes, three ways.

Issue 18 asks whether NCCL's all-reduce dominates a TP decode step at small messages, and
what a one-shot all-reduce (every rank reads every peer's buffer over NVLink and adds them
itself) would save. Each rank all-reduces ``rows x hidden`` activations, one row-parallel
layer's output at a decode batch of ``rows``:

* ``nccl``: ``dist.all_reduce``, the fast lane's sum (gloo on the CPU);
* ``gather_sum``: ``TPGroup.all_reduce_sum(canonical=True)``, Sid's canonical sum today: an
  all-gather, then the ranks' parts added in rank order, so every rank holds the same bits;
* ``one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` on a symmetric-memory buffer
  (CUDA with peer access only; NVLink multicast stays off).

Times are medians over ``--iters`` calls replayed from a CUDA graph of ``--calls`` calls (as
the engine's decode graphs run them; eager where a method cannot be captured), per call.
``same_bits`` says whether every rank got the same bits (what a canonical sum needs), and
``exact`` whether the result equals a float64 sum in rank order rounded once.

    python benchmarks/allreduce.py --out results/        # 2 GPUs of one host (nvidia-h200-x2)
    python benchmarks/allreduce.py --smoke               # CPU, gloo, two processes, seconds
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_args, table, write_json  # noqa: E402

from sid.runtime.distributed import TPGroup, init_group  # noqa: E402

METHODS = ("nccl", "gather_sum", "one_shot")
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")
):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off: it can take a shared host's GPUs down


def one_shot(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A one-shot all-reduce of ``x``'s values through a symmetric-memory buffer (raises where
    the machine or this torch has none)."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous by some torch versions
        symm_mem.enable_symm_mem_for_group(group)
    buffer = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buffer, group)
    buffer.copy_(x)
    return lambda: torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group)


def method(name: str, x: torch.Tensor, tp: TPGroup) -> Callable[[], torch.Tensor]:
    """A call that all-reduces ``x``'s values and returns the sum (``x`` itself is left as it is)."""
    if name == "nccl":
        work = x.clone()
        return lambda: (work.copy_(x), dist.all_reduce(work))[0]
    if name == "gather_sum":
        return lambda: tp.all_reduce_sum(x, canonical=True)
    return one_shot(x)


def timed(fn: Callable[[], torch.Tensor], device: torch.device, calls: int, iters: int) -> tuple[float, bool]:
    """Median microseconds a call, and whether a CUDA graph replayed them."""
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times), False
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, per_run = graph.replay, calls
    except Exception:  # noqa: BLE001 - a method that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        run, per_run = fn, 1
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_run)
    return statistics.median(times), per_run > 1


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
    init_group(store, rank, size, device, timedelta(seconds=60))
    tp = TPGroup(rank, size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator().manual_seed(1000 * rows + rank)
        x = torch.randn(rows, args.hidden, generator=gen).to(device=device, dtype=dtype)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        expect = sum((p.double() for p in parts), torch.zeros_like(x, dtype=torch.float64)).to(dtype)
        for name in METHODS:
            row: dict[str, Any] = {"rows": rows, "bytes": x.numel() * x.element_size(), "method": name}
            try:
                fn = method(name, x, tp)
                got = fn().clone()
                gathered = [torch.empty_like(got) for _ in range(size)]
                dist.all_gather(gathered, got)
                row["same_bits"] = all(torch.equal(g, gathered[0]) for g in gathered)
                row["exact"] = bool(torch.equal(got, expect))
                row["close"] = bool(torch.allclose(got.float(), expect.float(), rtol=2e-2, atol=2e-2))
                row["us"], row["graphed"] = timed(fn, device, args.calls, args.iters)
            except Exception as e:  # noqa: BLE001 - a method this machine lacks is reported, not fatal
                row["unavailable"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                if device.type == "cuda":
                    torch.cuda.synchronize()
            rows_out.append(row)
    if rank == 0:
        results.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    try:
        rank_main(rank, size, port, args, results)
    except BaseException:
        traceback.print_exc()
        raise


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,64,128,256", help="decode batch sizes: rows of each message")
    ap.add_argument("--hidden", type=int, default=4096, help="row width (4096: Llama-3.1-8B; 8192: 70B)")
    ap.add_argument("--calls", type=int, default=32, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=50)
    args = parse_args(ap, smoke=dict(rows="1,8", hidden=256, iters=5))
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} are visible")
    with torch.multiprocessing.get_context("spawn").Manager() as manager:
        results = manager.Queue()
        port = free_port()
        mp.spawn(_spawned, args=(args.world_size, port, args, results), nprocs=args.world_size, join=True)
        rows = results.get(timeout=10)
    nccl = {r["rows"]: r.get("us") for r in rows if r["method"] == "nccl"}
    for r in rows:
        if r.get("us") is not None and nccl.get(r["rows"]):
            r["of_nccl"] = r["us"] / nccl[r["rows"]]
    meta = {"device": args.device, "world_size": args.world_size, "hidden": args.hidden, "calls": args.calls,
            "iters": args.iters, "torch": torch.__version__}
    path = write_json("allreduce", {**meta, "rows": rows}, args.out)
    print(f"all-reduce of rows x {args.hidden} on {args.world_size} ranks ({args.device}), us a call")
    print(table(rows, ["rows", "bytes", "method", "us", "of_nccl", "graphed", "same_bits", "exact", "close",
                       "unavailable"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
