"""Time per decode step, every request deterministic vs every request normal.

A user who asks for determinism at a small batch sees its price as latency: the time of a
decode step. For each batch size, ``batch`` requests of ``--context`` prompt tokens generate
``--new-tokens`` tokens each through the engine's step API, once all normal and once all
deterministic (the same prompts), in interleaved rounds; the figure is the median wall time
of the steps that decode every request (no prompt rows), past the first few. Batch 1 also
runs at ``--long-context`` tokens. The ratio is deterministic over normal.

``--profile`` then runs every case once more of each kind under ``torch.profiler`` and
reports where the deterministic step's time goes: GPU microseconds per decode step by
kernel, deterministic against normal, the largest differences first (kernels replayed from
CUDA graphs included; ``--enforce-eager`` launches them one by one instead).

    python benchmarks/latency.py --model llama-3.1-8b --out results/     # H200, dummy weights
    python benchmarks/latency.py --smoke                                 # CPU, tiny model, seconds
    python benchmarks/latency.py ... --tp-invariant-chunks 8             # what TP-invariant sums cost
    python benchmarks/latency.py ... --batches 1 --rounds 1 --profile    # which kernels make the difference
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, SMOKE_MODEL, engine_device, model_dir, parse_args, table, write_json  # noqa: E402

from sid import LLM, SamplingParams  # noqa: E402
from sid.engine.engine import LLMEngine  # noqa: E402

SKIP_STEPS = 4
"""Decode steps left out at the start of a run (the last prompt chunks' results arrive then)."""
PROFILED_STEPS = 32
"""Decode steps a ``--profile`` run records at most, after the skipped ones."""


def decode_step_ms(
    engine: LLMEngine, batch: int, context: int, new_tokens: int, deterministic: bool, kernels: bool = False
) -> dict[str, Any]:
    """Median and mean ms of the run's decode steps, and how many there were; with ``kernels``,
    also each kernel's GPU microseconds (on a CPU: each operator's) per decode step, over the
    ``PROFILED_STEPS`` after the skipped ones (``kernel_us``)."""
    rng = random.Random(batch * 7919 + context)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, deterministic=deterministic)
    for i in range(batch):
        engine.add_request(f"lat-{i}", {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]}, params)
    times: list[float] = []
    cuda = engine.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) if kernels else None
    recording = False
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        scheduled = engine.scheduler.stats.scheduled_tokens
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.scheduler.stats.scheduled_tokens - scheduled == running == batch:
            times.append(elapsed * 1e3)
            if prof is not None and len(times) in (SKIP_STEPS, SKIP_STEPS + PROFILED_STEPS):
                _synchronize(cuda)
                if recording:
                    prof.stop()
                else:
                    prof.start()
                recording = not recording
    engine.reset_prefix_cache()
    if not times:
        raise ValueError(
            f"no step decoded all {batch} requests together: the first finished before the last prompt's prefill "
            f"ended; give more than {new_tokens} new tokens"
        )
    kept = times[SKIP_STEPS:] or times
    result: dict[str, Any] = {"ms": statistics.median(kept), "mean_ms": statistics.fmean(kept), "steps": len(kept)}
    if prof is not None:
        if recording:  # the run had fewer decode steps
            _synchronize(cuda)
            prof.stop()
        profiled = min(len(times) - SKIP_STEPS, PROFILED_STEPS)
        if profiled <= 0:
            raise ValueError(f"--profile needs more than {SKIP_STEPS} decode steps; give more new tokens")
        per_kernel: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if not cuda:  # the CPU's operators, by their own time
                per_kernel[event.name] += event.self_cpu_time_total / profiled
            elif event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name] += event.device_time / profiled
        result["kernel_us"] = dict(per_kernel)
    return result


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def kernel_differences(normal: dict[str, float], det: dict[str, float], top: int = 12) -> list[dict[str, Any]]:
    """The kernels whose GPU time per step differs most between the two kinds of step, and the totals."""
    rows: list[dict[str, Any]] = [
        {"kernel": name[:70], "normal_us": normal.get(name, 0.0), "deterministic_us": det.get(name, 0.0),
         "difference_us": det.get(name, 0.0) - normal.get(name, 0.0)}
        for name in normal.keys() | det.keys()
    ]
    rows.sort(key=lambda r: -abs(r["difference_us"]))
    busy = {"normal_us": sum(normal.values()), "deterministic_us": sum(det.values())}
    total = {"kernel": "all kernels", **busy, "difference_us": busy["deterministic_us"] - busy["normal_us"]}
    return [total, *rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint path or preset (llama-3.1-8b, qwen3-0.6b)")
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--long-context", type=int, default=32768, help="batch 1 also runs at this context (0: not)")
    ap.add_argument("--long-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) the model is split over")
    ap.add_argument("--tp-invariant-chunks", type=int, default=None,
                    help="deterministic passes split row-parallel K into this many chunks (its cost at TP=1)")
    ap.add_argument("--profile", action="store_true",
                    help="then run each case once more of each kind under torch.profiler: GPU time by kernel")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, batches="1,4", context=48, new_tokens=12, long_context=96,
                                     long_new_tokens=8, rounds=1))
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(b, args.context, args.new_tokens) for b in batches]
    if args.long_context:
        cases.append((1, args.long_context, args.long_new_tokens))
    longest = max(c + n for _, c, n in cases)
    llm = LLM(
        model_dir(args.model) if args.model else None,
        load_format="dummy" if args.model in PRESETS else "auto",
        device=engine_device(args),
        max_model_len=longest + 16,
        max_num_seqs=max(batches),
        tp_invariant_chunks=args.tp_invariant_chunks,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
    )
    engine = llm.llm_engine
    decode_step_ms(engine, min(batches), args.context, args.new_tokens, True)  # warm-up
    results: dict[tuple[int, int, bool], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for batch, context, new_tokens in cases:
            for deterministic in (False, True):
                run = decode_step_ms(engine, batch, context, new_tokens, deterministic)
                results.setdefault((batch, context, deterministic), []).append(run)
    rows = []
    for batch, context, _ in cases:
        normal, det = (statistics.median(r["ms"] for r in results[(batch, context, d)]) for d in (False, True))
        rows.append({"batch": batch, "context": context, "normal_ms": normal, "deterministic_ms": det,
                     "ratio": det / normal, "runs": {str(d): results[(batch, context, d)] for d in (False, True)}})
    profiles = []
    if args.profile:
        for batch, context, new_tokens in cases:
            normal, det = (
                decode_step_ms(engine, batch, context, new_tokens, d, kernels=True)["kernel_us"] for d in (False, True)
            )
            profiles.append({"batch": batch, "context": context, "kernels": kernel_differences(normal, det)})
    stats = engine.get_stats()
    meta = {"model": args.model or engine.config.model, "device": str(engine.device), "dtype": str(engine.dtype),
            "determinism": stats["determinism"], "gemm_paths": stats["gemm_paths"],
            "gemm_fast": stats["gemm_fast"], "gemm_padding": stats["gemm_padding"], "fingerprint": engine.fingerprint,
            "rounds": args.rounds, "tp_invariant_chunks": args.tp_invariant_chunks,
            "tensor_parallel_size": args.tensor_parallel_size, "enforce_eager": args.enforce_eager}
    path = write_json("latency", {**meta, "rows": rows, "profiles": profiles}, args.out)
    print(f"{meta['model']} on {meta['device']} ({meta['dtype']}), deterministic rows: {meta['determinism']}, "
          f"fast lane's other paths {meta['gemm_fast'] or 'none'}, "
          f"proven GEMMs' padding {meta['gemm_padding'] or 'none'}")
    unit = "GPU us per decode step by kernel" if meta["device"].startswith("cuda") else "CPU us per step by operator"
    for case in profiles:
        print(f"{unit}, batch {case['batch']} at {case['context']} tokens:")
        print(table(case["kernels"], ["kernel", "normal_us", "deterministic_us", "difference_us"]))
    print(table(rows, ["batch", "context", "normal_ms", "deterministic_ms", "ratio"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
