"""Where a decode attention launch spends its time: timestamps written by each of its programs.

A copy of ``sid/kernels/paged_attention.py`` is made in which every program of the attention
kernel reads the GPU's ``globaltimer`` at its start, once its sequence's schedule is known,
after its tile loop, before and after the fold of the partials (``_fold_if_last``), and its
multiprocessor; the stamps go to the launch's ticket row past the counters the fold uses. One
eager launch is read back, its outputs compared bit for bit with the unpatched kernel's, and
both kernels' times a call in 16-call CUDA graphs are given beside it. Times are µs from the
launch's first program start; ``start_spread_us`` is when the last program with keys to walk
started (a graph sized for more keys than a row holds launches programs that exit at once:
counted, they showed a canonical batch-1 launch starting over 9 µs). On 2026-12-03 (H200,
batch 1) this showed a lone program walking two 128-key tiles in ~8 µs with the GPU otherwise
idle, and the fold adding 2-5 µs at every context (docs/PERFORMANCE.md, twenty-fourth session).

On the CPU (``--smoke``) the interpreter runs the patched kernel with a constant in place of
the timer: it checks that the patch still fits the kernel and keeps its bits.

    python benchmarks/attention_timeline.py [--batches 1,8] [--contexts 512,8192,32768]   # H200
    python benchmarks/attention_timeline.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention  # noqa: E402  (switches the interpreter on off CUDA, before Triton's import)
from common import load_module, parse_args, table, write_json  # noqa: E402

from sid.kernels import paged_attention as kernels  # noqa: E402

SLOTS = 8
"""Slots a program's stamps take: start, scheduled, walked, fold from, end, multiprocessor
(-1 where it did not get that far)."""
MOST_PROGRAMS_A_ROW = 64
"""Programs along a row's keys at most in these launches (fast: 32 splits; canonical: 48)."""
FIRST_SLOT = 8192
"""Where the stamps start in the launch's ticket row (``_TICKETS`` int32): past the counters
of any launch timed here (one per query block and KV head)."""
TIMER = '''
if knobs.runtime.interpret:
    @triton.jit
    def _stamp():
        return tl.full((), 1, tl.int64)

    @triton.jit
    def _sm():
        return tl.full((), 0, tl.int32)
else:
    from triton.language.extra.cuda import globaltimer as _stamp, smid as _sm
'''
"""The patched module's clock: the timer on the GPU; under the interpreter, which runs no
inline PTX, a constant."""


def _store(slot: int) -> str:
    return f"    tl.store(_ts + {slot}, _stamp().to(tl.int32))\n"


def patched_source(source: str) -> str:
    """The kernel module with the stamps inserted, each before its anchor; fails where an
    anchor is gone (the kernel changed: move the stamp with it)."""
    program = "((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2))"
    insertions = [
        ("    seq, done, token, head, valid, pos, last_pos = _block_rows(\n        query_start_loc_ptr, seq_lens_ptr,"
         " num_seqs, GROUP, BLOCK_M, BLOCK_Q, not PROMPT, FAST_PREFILL\n",
         f"    _ts = tickets_ptr + {FIRST_SLOT} + {program} * {SLOTS}\n" + _store(0)),
        ("    first = tl.program_id(2) * group\n", _store(1)),
        ("    if first == 0:\n        complete = pos // split_size < stop\n", _store(2)),
        ("    if FOLD_LAST:\n        _fold_if_last(\n", _store(3)),
    ]
    after = [  # the kernel's last lines (its fold's call), and the imports
        ("            stride_oh, stride_od, GROUP, FOLD_ROWS, DIM, PREFETCH,\n        )  # fmt: skip\n",
         _store(4) + "    tl.store(_ts + 5, _sm())\n"),
        ("from triton import knobs\n", TIMER),
    ]
    for anchor, _ in insertions + after:
        assert source.count(anchor) == 1, f"the kernel changed: {anchor!r} is not there once"
    for anchor, text in insertions:
        source = source.replace(anchor, text + anchor)
    for anchor, text in after:
        source = source.replace(anchor, anchor + text)
    return source


def load_patched() -> ModuleType:
    path = Path(tempfile.mkdtemp()) / "paged_attention_timeline.py"
    path.write_text(patched_source(Path(kernels.__file__).read_text()))
    return load_module(path, "paged_attention_timeline")


def timeline(stamps: torch.Tensor) -> dict[str, float | int]:
    """A launch's phases from its programs' stamps ``[programs, SLOTS]`` (ns; -1 unreached)."""
    started = stamps[stamps[:, 0] != -1]
    worked = started[started[:, 2] != -1]
    ended = started[started[:, 4] != -1]
    t0 = started[:, 0].min()

    def us(x: torch.Tensor) -> float:
        return float((x - t0).float().max()) / 1e3 if x.numel() else 0.0

    return dict(
        programs=len(started), working=len(worked), start_spread_us=us(worked[:, 0]),
        walk_median_us=float(((worked[:, 2] - worked[:, 1]).float() / 1e3).median()) if len(worked) else 0.0,
        walked_by_us=us(worked[:, 2]),
        fold_us=float(((ended[:, 4] - ended[:, 3]).float() / 1e3).max()) if len(ended) else 0.0,
        end_us=us(ended[:, 4]), sms=int(worked[:, 5].unique().numel()),
    )  # fmt: skip


def run_case(patched: ModuleType, heads: int, kv_heads: int, head_dim: int, batch: int, context: int, limit: int,
             pool: tuple[torch.Tensor, torch.Tensor], smoke: bool) -> list[dict]:  # fmt: skip
    device = pool[0].device
    assert FIRST_SLOT + batch * kv_heads * MOST_PROGRAMS_A_ROW * SLOTS <= kernels._TICKETS, "too large a batch to stamp"
    args = attention.decode_case(*pool, heads, batch, context, device)
    rows = []
    for canonical in (False, True):
        outs, calls, graph_us = {}, {}, {}
        for name, module in (("head", kernels), ("patched", patched)):
            out = torch.full_like(args[0], float("nan"))
            outs[name] = out

            def call(module: ModuleType = module, out: torch.Tensor = out) -> None:
                module.paged_attention(*args, head_dim**-0.5, canonical=canonical, out=out, max_query_len=1,
                                       max_seq_len=limit)

            call()
            calls[name] = call
            if not smoke:
                graph_us[name] = statistics.median(attention.bench_graph(call, smoke) for _ in range(2)) * 1e3
        tickets = patched._tickets(device)
        for row in tickets:
            row[FIRST_SLOT:].fill_(-1)
        calls["patched"]()  # the launch whose stamps are read
        row = max(tickets, key=lambda t: int((t[FIRST_SLOT:] != -1).sum()))
        stamps = row[FIRST_SLOT:].view(-1, SLOTS).long().cpu()
        rows.append(dict(
            heads=heads, kv_heads=kv_heads, batch=batch, context=context, limit=limit,
            schedule="canonical" if canonical else "fast", graph_us=graph_us.get("head"),
            patched_graph_us=graph_us.get("patched"), **timeline(stamps),
            bits_equal=torch.equal(outs["head"], outs["patched"]),
        ))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--limit", type=int, default=attention.FULL.graph_limit,
                    help="keys the launch is sized for, as the engine's CUDA graphs are (the model's longest)")
    # Smoke: past a program's least keys (``_MIN_PROGRAM_KEYS``), so rows split and their fold runs.
    args = parse_args(ap, smoke=dict(batches="1,2", contexts="40,600", limit=1024))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    patched = load_patched()
    if args.smoke:
        for module in (kernels, patched):
            module.CANONICAL_CONFIG.update(attention.SMOKE_CONFIG)
    sizes = attention.SMOKE if args.smoke else attention.FULL
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for model, (heads, kv_heads, head_dim) in sizes.models.items():
        blocks = max(batches) * -(-max(contexts) // attention.BLOCK_SIZE) + 1
        shape = (blocks, attention.BLOCK_SIZE, kv_heads, head_dim)
        pool = (torch.randn(shape, dtype=attention.DTYPE, device=device),
                torch.randn(shape, dtype=attention.DTYPE, device=device))
        for batch in batches:
            for context in contexts:
                for row in run_case(patched, heads, kv_heads, head_dim, batch, context, args.limit, pool, args.smoke):
                    rows.append(dict(model=model, **row))
                    print(rows[-1], flush=True)
        del pool
    assert all(r["bits_equal"] for r in rows), "the stamps changed an output"
    path = write_json("attention_timeline", dict(rows=rows), args.out)
    print("\nµs from the launch's first program start; walk: a program's tile loop (median); fold: the last program's")
    print(table(rows, ["model", "batch", "context", "schedule", "graph_us", "patched_graph_us", "programs", "working",
                       "start_spread_us", "walk_median_us", "walked_by_us", "fold_us", "end_us", "sms", "bits_equal"]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
