"""Paged attention A/B: this tree's kernels against a base revision's, in one process.

A kernel change is judged by two things: whether each output keeps its bits (a canonical row
must, whatever the change; a fast one does unless the change means otherwise) and its time.
Both are measured here side by side, on the same inputs: the base's
``sid/kernels/paged_attention.py`` (``git show REV:...``, or a file) is loaded as a second
module, every case runs through both, the outputs are compared bit for bit, and the times come
from 16-call CUDA graphs taken in alternating order (new, base, new, base), medians of each.
Cases: prompts (fresh, and chunks after a cached prefix) and decode steps, Qwen3-0.6B and
Llama-3.1-8B heads, both schedules; prompt times also as a fraction of the bf16 matmul rate
measured in the same run. ``riding`` cases are decode steps launched as the engine's decode
graphs launch them when deterministic rows ride: one launch serving both schedules, sized for
more keys than the rows hold, with no row, every 50th row or every row canonical (their
``bits_equal`` compares the canonical rows: a fast row may change by design).

    python benchmarks/attention_ab.py --base cb33f21 [--out DIR]   # H200
    python benchmarks/attention_ab.py --base-file base_pa.py       # where the tree has no history
    python benchmarks/attention_ab.py --smoke                      # CPU interpreter, tiny sizes
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention  # noqa: E402  (switches the interpreter on off CUDA, before Triton's import)
from common import load_module, parse_args, table, write_json  # noqa: E402

from sid.kernels import paged_attention as new_kernels  # noqa: E402

KERNEL_PATH = "sid/kernels/paged_attention.py"
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
CASES = [(1, 8192, 0), (8, 2048, 0), (1, 32768, 0), (2, 2048, 16384), (4, 512, 0), (16, 256, 512), (64, 128, 768),
         (1, 1, 8191), (1, 1, 32767), (8, 1, 8191), (1, 1, 799), (1, 1, 511), (64, 1, 8191),
         (2, 1, 8191), (4, 1, 8191), (16, 1, 8191), (32, 1, 8191), (36, 1, 8191), (40, 1, 8191), (48, 1, 8191),
         (56, 1, 8191), (4, 1, 32767), (8, 1, 32767)]
"""(sequences, query rows each, cached keys before them): a query row of 1 is a decode step."""
RIDING_CASES = [
    (8, (200, 1500)), (16, (200, 1500)), (64, (200, 1500)), (256, (200, 1500)),
    (1, (8192, 8192)), (8, (8192, 8192)), (16, (8192, 8192)), (32, (8192, 8192)), (64, (8192, 8192)),
]
"""(sequences, (fewest, most) keys each, drawn uniformly) of the riding cases."""
RIDING_EVERY = {"fast only": None, "both, none": 0, "both, 1 in 50": 50, "both, all": 1}
"""Compositions of a riding case: every how many rows is canonical in a launch serving both
schedules (0: none), or a fast-only launch (None)."""
RIDING_LAUNCH_KEYS = 4096
"""A riding launch is sized for a multiple of this many keys (``attention.SMOKE``'s graph limit in a
smoke run), as a graph is for the model's limit."""
SMOKE_MODELS = {"tiny-gqa4": (4, 1, 32)}
SMOKE_CASES = [(2, 32, 0), (4, 40, attention.SMOKE_SPLIT - 4), (2, 1, attention.SMOKE_SPLIT + 20)]
"""The second and third cross a canonical split (``attention.SMOKE_CONFIG``); in the second, the batch gives
each prompt program both splits to fold."""
SMOKE_RIDING = [(3, (20, attention.SMOKE_SPLIT + 20))]


def load_base(rev: str, path: str | None) -> ModuleType:
    """The base revision's kernel module, loaded under a name of its own."""
    if path is None:
        source = subprocess.run(["git", "show", f"{rev}:{KERNEL_PATH}"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout
        path = str(Path(tempfile.mkdtemp()) / "base_paged_attention.py")
        Path(path).write_text(source)
    return load_module(path, "base_paged_attention")


def run_case(
    kernels: dict[str, ModuleType], heads: int, kv_heads: int, head_dim: int, seqs: int, rows: int, prefix: int,
    flops: float, device: torch.device, smoke: bool,
) -> list[dict]:  # fmt: skip
    """Both schedules of one case through every module: bits compared, times interleaved."""
    context = prefix + rows
    step = attention.Step.random(heads, kv_heads, head_dim, [context] * seqs, [rows] * seqs, device)
    step.store()
    flop = 4 * heads * head_dim * seqs * (rows * prefix + rows * (rows + 1) // 2)
    found = []
    for canonical in (False, True):
        outs, new_ms, base_ms = compare(kernels, step, smoke, canonical=canonical, max_query_len=rows,
                                        max_seq_len=context)  # fmt: skip
        found.append(dict(
            kind="decode" if rows == 1 else "prompt", seqs=seqs, rows=rows, prefix=prefix,
            schedule="canonical" if canonical else "fast", base_us=base_ms * 1e3, new_us=new_ms * 1e3,
            new_over_base=new_ms / base_ms, of_matmul_rate=flop / (new_ms * 1e-3) / flops if rows > 1 else None,
            bits_equal=torch.equal(outs["new"], outs["base"]), nan=bool(outs["new"].isnan().any()),
        ))  # fmt: skip
    return found


def run_riding(
    kernels: dict[str, ModuleType], heads: int, kv_heads: int, head_dim: int, seqs: int, keys: tuple[int, int],
    device: torch.device, smoke: bool,
) -> list[dict]:  # fmt: skip
    """One decode step of ``seqs`` rows of ``keys`` keys as a riding decode graph launches it, in
    each composition of ``RIDING_EVERY``."""
    gen = torch.Generator().manual_seed(seqs)
    contexts = torch.randint(keys[0], keys[1] + 1, (seqs,), generator=gen).tolist()
    step = attention.Step.random(heads, kv_heads, head_dim, contexts, [1] * seqs, device)
    step.store()
    unit = attention.SMOKE.graph_limit if smoke else RIDING_LAUNCH_KEYS
    launch_keys = -(-max(contexts) // unit) * unit
    found = []
    for composition, every in RIDING_EVERY.items():
        canonical_rows = torch.tensor([bool(every) and i % every == 0 for i in range(seqs)], device=device)
        # Per-sequence flags with no ``schedules`` make the launch serve both, as a riding graph's does.
        flags = False if every is None else canonical_rows.to(torch.int32)
        outs, new_ms, base_ms = compare(kernels, step, smoke, canonical=flags, max_query_len=1,
                                        max_seq_len=launch_keys)  # fmt: skip
        found.append(dict(
            kind="riding", seqs=seqs, rows=1, prefix=f"{keys[0]}-{keys[1]}", schedule=composition,
            base_us=base_ms * 1e3, new_us=new_ms * 1e3, new_over_base=new_ms / base_ms, of_matmul_rate=None,
            bits_equal=torch.equal(outs["new"][canonical_rows], outs["base"][canonical_rows])
            if bool(canonical_rows.any()) else None,
            nan=bool(outs["new"].isnan().any()),
        ))  # fmt: skip
    return found


def compare(
    kernels: dict[str, ModuleType], step: attention.Step, smoke: bool, **kw: object
) -> tuple[dict[str, torch.Tensor], float, float]:
    """Each module's output of one call on ``step`` (keyword arguments ``kw``), and the new and
    base modules' times in ms: medians of calls taken in alternating order."""
    outs = {name: torch.full_like(step.q, float("nan")) for name in kernels}
    calls = {}
    for name, module in kernels.items():
        def call(module: ModuleType = module, out: torch.Tensor = outs[name]) -> None:
            module.paged_attention(
                step.q, step.k_cache, step.v_cache, step.table, step.seq_lens, step.query_start_loc,
                step.q.shape[2] ** -0.5, out=out, k=step.key, v=step.value, **kw,
            )  # fmt: skip

        call()
        calls[name] = call
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(1 if smoke else 2):
        for name, call in calls.items():
            times[name].append(attention.bench(call, smoke) if smoke else attention.bench_graph(call, smoke))
    new_ms, base_ms = (statistics.median(times[name]) for name in ("new", "base"))
    return outs, new_ms, base_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels are the base")
    ap.add_argument("--base-file", default=None, help="the base's paged_attention.py itself (instead of --base)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--kinds", default="prompt,decode,riding", help="cases to run, of prompt, decode and riding")
    args = parse_args(ap)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = {"new": new_kernels, "base": load_base(args.base, args.base_file)}
    if args.smoke:
        for module in kernels.values():
            module.CANONICAL_CONFIG.update(attention.SMOKE_CONFIG)
    sizes = attention.SMOKE if args.smoke else attention.FULL
    flops = attention.measure_matmul(sizes, device, args.smoke)
    models = SMOKE_MODELS if args.smoke else {name: MODELS[name] for name in args.models.split(",")}
    torch.manual_seed(0)
    kinds = args.kinds.split(",")
    rows = []
    for model, shape in models.items():
        runs = [
            functools.partial(run_case, kernels, *shape, *case, flops, device, args.smoke)
            for case in (SMOKE_CASES if args.smoke else CASES)
            if ("decode" if case[1] == 1 else "prompt") in kinds
        ]
        if "riding" in kinds:
            runs += [
                functools.partial(run_riding, kernels, *shape, seqs, keys, device, args.smoke)
                for seqs, keys in (SMOKE_RIDING if args.smoke else RIDING_CASES)
            ]
        for run in runs:
            for row in run():
                rows.append(dict(model=model, **row))
                print(rows[-1], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = args.base_file or args.base
    path = write_json("attention_ab", dict(base=base, matmul_tflops=flops / 1e12, rows=rows), args.out)
    print(f"\nnew = this tree, base = {base}; bf16 matmul {flops / 1e12:.0f} TFLOP/s; times in µs")
    print(table(rows, ["model", "kind", "seqs", "rows", "prefix", "schedule", "base_us", "new_us", "new_over_base",
                       "of_matmul_rate", "bits_equal", "nan"]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
