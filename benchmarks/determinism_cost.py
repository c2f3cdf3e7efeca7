"""Cost of determinism (DESIGN 7): offline throughput with 0/2/10/50/100 % deterministic traffic.

Each fraction runs the same workload (median of ``--repeats`` runs), normalised to 0 %. The
runs go in rounds, one run of every fraction per round, after a warm-up run of the whole
workload, so what drifts over the process's life (the first run's compilation, the block
pool's order, the host) weighs on every fraction alike.
Reported beside it: the throughput of the *non-deterministic* requests alone (what the
router's choice costs everyone else), rollbacks, recomputed tokens and which strategy the
scheduler chose. Deterministic requests are chosen by a seeded draw, so every run of a
fraction routes the same requests. Every run starts with the prefix cache reset, so it
computes every prompt (``--keep-prefix-cache`` lets the repeats find the prompts cached by
the runs before them, as the figures recorded before the fifth session did).

    python benchmarks/determinism_cost.py --smoke                         # CPU, tiny model, seconds
    python benchmarks/determinism_cost.py --model qwen3-0.6b --requests 256   # H200, dummy weights
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PRESETS,
    SMOKE_MODEL,
    engine_device,
    lognormal_workload,
    model_dir,
    parse_args,
    table,
    workload,
    write_json,
)

from sid import LLM, RequestOutput, SamplingParams  # noqa: E402
from sid.engine.engine import LLMEngine  # noqa: E402
from sid.engine.plan import StepPlan  # noqa: E402
from sid.kernels.paged_attention import CANONICAL_CONFIG  # noqa: E402
from sid.runtime.model_runner import LaunchedPass  # noqa: E402

FRACTIONS = (0.0, 0.02, 0.10, 0.50, 1.0)
STEP_BINS = ((16, "decode <=16"), (64, "decode <=64"), (128, "decode <=128"), (1 << 30, "decode >128"))
STEP_KINDS = ("with prompt rows", *(name for _, name in STEP_BINS))


@contextmanager
def step_log(engine: LLMEngine, spent: dict[str, list[float]], trace: list[dict[str, object]]) -> Iterator[None]:
    """Wall seconds and count of the engine's steps, by kind (where a fraction's extra time
    goes): steps that schedule more rows than requests (prompt chunks, or verification
    windows of several rows), and the other steps by how many requests are unfinished.
    ``trace`` gets one entry per step: its kind, wall ms, fast rows, canonical passes' rows,
    the strategy the scheduler chose, the ms the step spent in Python's garbage collector,
    the ms it waited for the GPU, the ms of CPU time its thread got (a step much longer than
    its wait and CPU time together is a host thread that wanted to run and did not; the wait
    for the GPU spins, so it counts as CPU time) and the ms of CPU time the whole process got
    (more than the thread's is other threads working or spinning beside it). Steps of the same
    make-up compare across runs."""
    original, schedule, wait = engine.step, engine.scheduler.schedule, LaunchedPass.wait
    plans: list[StepPlan] = []
    collecting = [0.0, 0.0]  # start of the collection under way, seconds collected this step
    waited = [0.0]

    def timed_wait(launched: LaunchedPass) -> None:
        start = time.perf_counter()
        wait(launched)
        waited[0] += time.perf_counter() - start

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            collecting[1] += time.perf_counter() - collecting[0]

    def planned() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    def timed() -> list[RequestOutput]:
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        tokens = engine.scheduler.stats.scheduled_tokens
        plans.clear()
        collecting[1] = waited[0] = 0.0
        start, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
        try:
            return original()
        finally:
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            process = time.process_time() - process
            prompt = engine.scheduler.stats.scheduled_tokens - tokens > running
            kind = "with prompt rows" if prompt else next(name for top, name in STEP_BINS if running <= top)
            spent[kind][0] += wall
            spent[kind][1] += 1
            plan = plans[-1] if plans else StepPlan()
            trace.append({
                "kind": kind,
                "ms": round(wall * 1e3, 3),
                "fast": sum(c.num_tokens for c in plan.fast),
                "canonical": [sum(c.num_tokens for c in p) for p in plan.canonical],
                "strategy": plan.strategy,
                "gc_ms": round(collecting[1] * 1e3, 3),
                "wait_ms": round(waited[0] * 1e3, 3),
                "cpu_ms": round(cpu * 1e3, 3),
                "process_cpu_ms": round(process * 1e3, 3),
            })

    engine.step = timed  # type: ignore[method-assign]
    engine.scheduler.schedule = planned  # type: ignore[method-assign]
    LaunchedPass.wait = timed_wait  # type: ignore[method-assign]
    gc.callbacks.append(collector)
    try:
        yield
    finally:
        gc.callbacks.remove(collector)
        LaunchedPass.wait = wait  # type: ignore[method-assign]
        del engine.step, engine.scheduler.schedule


def run_once(
    llm: LLM, requests: list[tuple[list[int], int]], fraction: float, log_steps: bool = False
) -> dict[str, float]:
    rng = random.Random(1)
    flags = [rng.random() < fraction for _ in requests]
    params = [
        SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True, deterministic=flag)
        for (_, out), flag in zip(requests, flags)
    ]
    before = llm.stats()
    spent: dict[str, list[float]] = {kind: [0.0, 0] for kind in STEP_KINDS} if log_steps else {}
    trace: list[dict[str, object]] = []
    started = time.time()
    start = time.perf_counter()
    with step_log(llm.llm_engine, spent, trace) if log_steps else nullcontext():
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    normal_tokens = sum(len(o.outputs[0].token_ids) for o, f in zip(outs, flags) if not f)
    return {
        "started": started,
        "seconds": seconds,
        "output_tok_s": out_tokens / seconds,
        "normal_output_tok_s": normal_tokens / seconds,
        "deterministic_requests": sum(flags),
        "rollbacks": after["rollbacks"] - before["rollbacks"],
        "recomputed_tokens": after["recomputed_tokens"] - before["recomputed_tokens"],
        "proposed_tokens": after["proposed_tokens"] - before["proposed_tokens"],
        "canonical_passes": after["canonical_passes"] - before["canonical_passes"],
        **{f"chose_{k}": v - before["strategy_choices"][k] for k, v in after["strategy_choices"].items()},
        **{f"{kind} s": v[0] for kind, v in spent.items()},
        **{f"{kind} steps": v[1] for kind, v in spent.items()},
        **({"trace": trace} if log_steps else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint path or preset (llama-3.1-8b, qwen3-0.6b)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--workload", choices=["uniform", "lognormal"], default="uniform",
                    help="uniform: lengths in [min-len, max-len] (DESIGN 7); lognormal: a long tail of prompt and "
                         "output lengths, medians --median-prompt / --median-output, clipped to --max-len")
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--median-prompt", type=int, default=256)
    ap.add_argument("--median-output", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-space spread of the lognormal workload's lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (bfloat16 on a CPU: rows ride there too)")
    ap.add_argument("--canonical-rows", type=int, default=None)
    ap.add_argument("--max-canonical-rows", type=int, default=None,
                    help="largest canonical pass (default: the engine's)")
    ap.add_argument("--verify-window", type=int, default=8)
    ap.add_argument("--canonical-config", default=None,
                    help="JSON file of canonical attention constants to run with (canonical_sweep.py writes one); "
                         "they are part of the numerics fingerprint")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="let a run find the prompts the runs before it cached (the repeats submit the same "
                         "requests; by default every run starts with the prefix cache reset, so it computes them)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) the model is split over")
    ap.add_argument("--step-log", action="store_true",
                    help="also time the engine's steps by kind (steps with prompt rows; decode steps by batch size)")
    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, requests=16, min_len=8, max_len=32, median_prompt=12,
                                     median_output=8, repeats=1))
    if args.canonical_config:
        CANONICAL_CONFIG.update(json.loads(Path(args.canonical_config).read_text()))
    llm = LLM(
        model_dir(args.model) if args.model else None,
        load_format="dummy" if args.model in PRESETS else "auto",
        device=engine_device(args),
        max_model_len=2 * args.max_len + 16,
        canonical_rows=args.canonical_rows,
        max_canonical_rows=args.max_canonical_rows,
        verify_window=args.verify_window,
        determinism_strategy=args.strategy,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    if args.workload == "uniform":
        requests = workload(args.requests, args.min_len, args.max_len, vocab)
    else:
        requests = lognormal_workload(
            args.requests, args.median_prompt, args.median_output, args.sigma, args.max_len, vocab
        )
    run_once(llm, requests, 0.5)  # warm-up: allocator, kernels, graphs
    fractions = [float(f) for f in args.fractions.split(",")]
    runs: dict[float, list[dict[str, float]]] = {f: [] for f in fractions}
    for i in range(args.repeats):
        for fraction in fractions:
            if not args.keep_prefix_cache and not llm.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset: requests are still unfinished")
            runs[fraction].append(run_once(llm, requests, fraction, args.step_log))
            print(f"round {i + 1} fraction {fraction:.2f}: {runs[fraction][-1]['output_tok_s']:.0f} out tok/s, "
                  f"{runs[fraction][-1]['rollbacks']} rollbacks")  # progress, in case the call is cut short
    rows = []
    for fraction, done in runs.items():
        median = {k: statistics.median(r[k] for r in done) for k in done[0] if k not in ("trace", "started")}
        rows.append({"fraction": fraction, **median, "runs": done})
    base = rows[0]["output_tok_s"]
    for row in rows:
        row["normalised"] = row["output_tok_s"] / base
        row["normal_share"] = row["normal_output_tok_s"] / base
    meta = {
        "model": args.model or engine.config.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "tensor_parallel_size": args.tensor_parallel_size,
        "canonical_rows": engine.canonical_rows,
        "canonical_sizes": list(engine.canonical.sizes),
        "verify_window": engine.config.verify_window,
        "strategy": args.strategy,
        "requests": args.requests,
        "workload": args.workload,
        "lengths": [args.min_len, args.max_len] if args.workload == "uniform" else
        {"median_prompt": args.median_prompt, "median_output": args.median_output, "sigma": args.sigma,
         "max": args.max_len, "prompt_tokens": sum(len(p) for p, _ in requests),
         "output_tokens": sum(n for _, n in requests)},
        "fingerprint": engine.fingerprint,
        "torch_threads": torch.get_num_threads(),
        "determinism": llm.stats()["determinism"],
        "gemm_paths": llm.stats()["gemm_paths"],
        "prefix_cache_reset_per_run": not args.keep_prefix_cache,
        "canonical_attention": engine.numerics["attention"],
        "pass_costs": asdict(engine.scheduler.windowed.cost_model),  # type: ignore[call-overload]
    }
    path = write_json("determinism_cost", {**meta, "rows": rows}, args.out)
    cols = ["fraction", "output_tok_s", "normalised", "normal_output_tok_s", "rollbacks", "recomputed_tokens",
            "proposed_tokens", "canonical_passes", "chose_ride", "chose_speculate", "chose_direct", "chose_whole"]
    print(f"{meta['model']} on {meta['device']} ({meta['dtype']}), {args.workload} workload, deterministic rows: "
          f"{meta['determinism']}, pass sizes {meta['canonical_sizes'][0]}..{meta['canonical_sizes'][-1]}, "
          f"W={meta['verify_window']}")
    print(table(rows, cols))
    print(f"the scheduler's pass costs: {meta['pass_costs']}")
    if args.step_log:
        cols = ["fraction", *(f"{k} {unit}" for k in STEP_KINDS for unit in ("s", "steps"))]
        print("median seconds and steps by kind of step:")
        print(table(rows, cols))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
