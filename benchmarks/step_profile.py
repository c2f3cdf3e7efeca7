"""Where a step's time goes: host work vs GPU kernels, and the heaviest kernels.

Runs a slice of the throughput workload twice: once timed per step (wall time of
``LLMEngine.step`` and of its host-side phases, see ``PHASES``), once under
``torch.profiler`` for the GPU kernel totals (kernels replayed inside CUDA graphs may be
missing from those). A step whose wall time is much longer than its kernels' is
host-bound; overlapped scheduling (the default on a GPU) hides the host's share, and
``--no-async-scheduling`` measures the lockstep engine for comparison.

    python benchmarks/step_profile.py --model qwen3-0.6b [--deterministic 1.0] [--no-async-scheduling]   # H200
    python benchmarks/step_profile.py --smoke                     # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, SMOKE_MODEL, engine_device, model_dir, parse_args, table, workload, write_json  # noqa: E402

from sid import LLM, SamplingParams  # noqa: E402
from sid.engine.engine import LLMEngine  # noqa: E402
from sid.engine.scheduler import Scheduler  # noqa: E402
from sid.runtime.cuda_graphs import CUDAGraphs  # noqa: E402
from sid.runtime.model_runner import ModelRunner  # noqa: E402


def submit(
    engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str, deterministic: float = 0.0
) -> None:
    """Add the requests; the first ``deterministic`` share of them asks for determinism."""
    for i, (prompt, n) in enumerate(requests):
        params = SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True, deterministic=i < deterministic * len(requests)
        )
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)


PHASES: dict[str, tuple[type, str]] = {
    "schedule": (Scheduler, "schedule"),
    "launch": (ModelRunner, "launch"),
    "layout": (ModelRunner, "_layout"),
    "graph_load": (CUDAGraphs, "load"),
    "graph_replay": (CUDAGraphs, "replay"),
    "sampling_batch": (ModelRunner, "_sampling_batch"),
    "collect": (ModelRunner, "collect"),
    "apply": (LLMEngine, "_apply"),
}
"""Host-side phases timed per step (wall ms of each call). ``collect`` holds the wait for
the sampled tokens, so GPU time the host waits for shows up there; with overlapped
scheduling it is the previous step's tokens, waited for after this step was launched."""


@contextmanager
def phase_timers(spent: dict[str, float]) -> Iterator[None]:
    originals = {name: getattr(cls, attr) for name, (cls, attr) in PHASES.items()}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += (time.perf_counter() - start) * 1e3

        return wrapper

    for name, (cls, attr) in PHASES.items():
        setattr(cls, attr, timed(name, originals[name]))
    try:
        yield
    finally:
        for name, (cls, attr) in PHASES.items():
            setattr(cls, attr, originals[name])


def timed_steps(engine: LLMEngine) -> list[dict[str, Any]]:
    """Run to completion; per step: wall ms, each phase's ms, whether every row was a decode."""
    spent: dict[str, float] = defaultdict(float)
    steps = []
    with phase_timers(spent):
        while engine.has_unfinished_requests():
            spent.clear()
            sched = engine.scheduler
            decode = not sched.waiting and all(len(r.token_ids) - r.num_computed_tokens == 1 for r in sched.running)
            canonical_before = engine.scheduler.stats.canonical_passes
            start = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - start) * 1e3
            passes = engine.scheduler.stats.canonical_passes - canonical_before
            steps.append({"wall": wall, **{k: spent[k] for k in PHASES}, "decode": decode, "canonical_passes": passes})
    return steps


def summarise(steps: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Median ms per step of the wall time and of each phase."""
    row: dict[str, Any] = {"steps": kind, "count": len(steps), "total_s": sum(s["wall"] for s in steps) / 1e3}
    for key in ("wall", "canonical_passes", *PHASES):
        row[key] = statistics.median(s[key] for s in steps) if steps else 0.0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt (prompts are 100 .. this long)")
    ap.add_argument("--max-model-len", type=int, default=2064)
    ap.add_argument("--deterministic", type=float, default=0.0, help="share of deterministic requests")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap the host's work with the GPU's (default: the engine's default)")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, requests=8, new_tokens=16, max_len=128, max_model_len=256))
    llm = LLM(model_dir(args.model), load_format="dummy" if args.model in PRESETS else "auto",
              device=engine_device(args),
              max_model_len=args.max_model_len,
              enable_determinism=args.deterministic > 0, async_scheduling=args.async_scheduling)
    engine = llm.llm_engine
    high = args.max_len
    requests = [
        (p, args.new_tokens) for p, _ in workload(args.requests, min(100, high), high, engine.model_config.vocab_size)
    ]
    submit(engine, requests[:4], "warm")
    timed_steps(engine)
    submit(engine, requests, "timed", args.deterministic)
    start = time.perf_counter()
    steps = timed_steps(engine)
    wall = time.perf_counter() - start
    rows = [summarise([s for s in steps if s["decode"]], "decode only"),
            summarise([s for s in steps if not s["decode"]], "with prefill"), summarise(steps, "all")]

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    submit(engine, requests, "profiled", args.deterministic)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        timed_steps(engine)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiled_wall = time.perf_counter() - start
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] += e.device_time / 1e3
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    kernel_rows = [{"kernel": k, "ms": v, "share": v / busy if busy else 0.0} for k, v in top]
    meta = {"model": args.model, "device": str(engine.device), "deterministic": args.deterministic,
            "async_scheduling": engine.async_scheduling, "wall_s": wall,
            "output_tok_s": args.requests * args.new_tokens / wall, "profiled_wall_s": profiled_wall,
            "gpu_busy_s": busy / 1e3, "gpu_busy_share": busy / 1e3 / profiled_wall}
    out = write_json(f"step_profile_{Path(args.model or 'default').name}",
                     {**meta, "rows": rows, "kernels": kernel_rows, "steps": steps}, args.out)
    print(table(kernel_rows, ["kernel", "ms", "share"]))
    overlap = "overlapped" if engine.async_scheduling else "lockstep"
    print(f"{args.model} ({overlap}): {args.requests} req x {args.new_tokens} new: {wall:.2f} s, "
          f"{meta['output_tok_s']:.0f} out tok/s; "
          f"under the profiler the GPU was busy {busy / 1e3:.2f} s of {profiled_wall:.2f} s "
          f"({meta['gpu_busy_share']:.0%})")
    print("median ms per step:")
    print(table(rows, ["steps", "count", "total_s", "wall", "canonical_passes", *PHASES]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
