"""Host time against GPU time of a prompt step's attention, a layer.

A prompt step runs each layer's attention eagerly between its CUDA graph pieces, so the host
launches it 28-32 times a step; where that takes longer than the GPU's work, the GPU waits.
One step's metadata is planned once (``plan_attention``), as the Triton backend does, then its
layers run (``run_attention``):

* host us a layer: enqueueing all layers, queued behind a GPU sleep so the host never waits;
* GPU us a layer: CUDA events around the same layers (none off CUDA);
* plan us: one ``plan_attention``;
* direct: launches the layers after the first made without Triton's JIT call (``Relaunch``).

The step: decodes of some hundred keys beside prompts (own K/V given), in four compositions:
all fast, every 10th decode deterministic, that and half the prompts, all deterministic. A
two-argument Triton kernel's launch time is printed beside, to tell a slow host from slow code.

    python benchmarks/attention_host.py [--heads 16,8,128] [--out DIR]   # H200: Qwen3-0.6B heads
    python benchmarks/attention_host.py --smoke                          # CPU interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention as inputs  # noqa: E402  (switches the interpreter on off CUDA, before Triton's import)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import bench_device, parse_args, table, write_json  # noqa: E402

from sid.kernels import paged_attention as attention  # noqa: E402

COMPOSITIONS: dict[str, Callable[[int, int], list[int]]] = {
    "fast": lambda decodes, prompts: [0] * (decodes + prompts),
    "decodes mixed": lambda decodes, prompts: [int(i % 10 == 0) for i in range(decodes)] + [0] * prompts,
    "mixed": lambda decodes, prompts: [int(i % 10 == 0) for i in range(decodes)] + [i % 2 for i in range(prompts)],
    "canonical": lambda decodes, prompts: [1] * (decodes + prompts),
}
"""Per-sequence schedule flags (1: deterministic) of a step's decodes, then its prompts."""


@triton.jit
def _copy(x, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n), mask=offsets < n)


def _host_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Host us a call of ``fn``, enqueued behind a GPU sleep (so no call waits for the GPU)."""
    if device.type == "cuda":
        torch.cuda._sleep(50_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seconds / calls * 1e6


def _gpu_us(fn: Callable[[], object], calls: int, device: torch.device) -> float | None:
    """GPU us a call of ``fn``: events around ``calls`` calls queued behind a sleep."""
    if device.type != "cuda":
        return None
    torch.cuda._sleep(50_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


class Step:
    """A prompt step's attention inputs: ``decodes`` one-row sequences of ``decode_keys`` keys,
    then ``prompts`` fresh prompts of ``prompt_rows`` rows, in a shuffled paged cache, the
    step's own K/V stored (``benchmarks/attention.py``'s ``Step``)."""

    def __init__(self, heads: tuple[int, int, int], decodes: int, decode_keys: int, prompts: int, prompt_rows: int,
                 device: torch.device) -> None:  # fmt: skip
        q_lens = [1] * decodes + [prompt_rows] * prompts
        self.seq_lens = [decode_keys] * decodes + [prompt_rows] * prompts
        self.step = inputs.Step.random(*heads, self.seq_lens, q_lens, device)
        self.step.store()
        self.decodes, self.max_query_len = decodes, max(q_lens)
        self.out = torch.empty_like(self.step.q)

    def planner(self, flags: list[int]) -> Callable[[], attention.AttentionPlan]:
        """The step's planning, as the Triton backend does it from the engine's metadata: the
        flags reach the device before it (so timing it waits for no copy)."""
        def kinds(part: list[int]) -> tuple[bool, bool]:
            return 0 in part, 1 in part

        step = self.step
        canonical = torch.tensor(flags, dtype=torch.int32, device=step.q.device)
        return functools.partial(
            attention.plan_attention, step.q, step.k_cache, step.table, step.seq_lens, step.query_start_loc,
            canonical=canonical, max_query_len=self.max_query_len, max_seq_len=max(self.seq_lens),
            schedules=kinds(flags), own_keys=True, num_decodes=self.decodes,
            part_schedules=(kinds(flags[: self.decodes]), kinds(flags[self.decodes :])),
        )  # fmt: skip

    def layer(self, plan: attention.AttentionPlan) -> None:
        step = self.step
        attention.run_attention(plan, step.q, step.k_cache, step.v_cache, 0.088, out=self.out, k=step.key, v=step.value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head_dim (Qwen3-0.6B's)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--decodes", type=int, default=100)
    ap.add_argument("--decode-keys", type=int, default=700)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-rows", type=int, default=480)
    ap.add_argument("--rounds", type=int, default=20, help="rounds of all layers; medians are reported")
    args = parse_args(ap, smoke=dict(heads="4,2,32", layers=1, decodes=17, decode_keys=40, prompts=2,
                                     prompt_rows=24, rounds=1))  # fmt: skip
    device = bench_device(args)
    torch.manual_seed(0)
    heads = tuple(int(x) for x in args.heads.split(","))
    step = Step(heads, args.decodes, args.decode_keys, args.prompts, args.prompt_rows, device)  # type: ignore[arg-type]
    rows = []
    for name, compose in COMPOSITIONS.items():
        flags = compose(args.decodes, args.prompts)
        planner = step.planner(flags)
        plan_us = statistics.median(_host_us(planner, 1, device) for _ in range(args.rounds))
        plan = planner()

        passes = []

        def layers(plan: attention.AttentionPlan = plan) -> None:
            passes.append(args.layers)
            for _ in range(args.layers):
                step.layer(plan)

        layers()  # compiles, and keeps the kernels for the layers after the first
        host = statistics.median(_host_us(layers, 1, device) / args.layers for _ in range(args.rounds))
        gpu = [_gpu_us(layers, 1, device) for _ in range(args.rounds)]
        combines = sum(one.combine is not None for one in plan.launches)
        kernels = (len(plan.launches) + combines) * sum(passes)
        rows.append({
            "composition": name, "launches": len(plan.launches), "combines": combines,
            "plan us": plan_us, "host us a layer": host,
            "gpu us a layer": statistics.median(g / args.layers for g in gpu) if gpu[0] is not None else None,
            "direct": f"{sum(one.relaunch.direct for one in plan.launches)}/{kernels}",
        })  # fmt: skip
    x = torch.zeros(16, device=device)
    _copy[(1,)](x, 16, BLOCK=16)
    tiny = _host_us(lambda: _copy[(1,)](x, 16, BLOCK=16), 10 if args.smoke else 200, device)
    columns = ["composition", "launches", "combines", "plan us", "host us a layer", "gpu us a layer", "direct"]
    write_json("attention_host", {"args": vars(args), "device": str(device), "tiny_launch_us": tiny, "rows": rows},
               args.out)  # fmt: skip
    print(f"heads {heads}, {args.decodes} decodes of {args.decode_keys} keys beside {args.prompts} prompts of "
          f"{args.prompt_rows} rows, {args.layers} layers; a two-argument Triton launch {tiny:.1f} us")  # fmt: skip
    print(table(rows, columns))


if __name__ == "__main__":
    main()
