"""Shared pieces of the benchmarks: real model shapes for dummy weights, the workload, output,
and ``--smoke``: every benchmark's own run at toy sizes on the CPU, in seconds, so CI runs them
all (tests/test_benchmarks.py) and none rots unnoticed. A new benchmark gets it in two lines::

    args = parse_args(ap, smoke=dict(model=SMOKE_MODEL, requests=8))   # adds --smoke and --out
    llm = LLM(model_dir(args.model), device=engine_device(args), ...)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sid.model.builtin import TINY_SHAPE

SMOKE_MODEL = "tiny"
"""The preset ``--smoke`` runs: Sid's built-in tiny Llama shape (sid.model.builtin), dummy weights."""

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
    SMOKE_MODEL: {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY_SHAPE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}
GPU_PRESETS = [name for name in PRESETS if name != SMOKE_MODEL]
"""The real models' shapes (what a benchmark measures on the GPU when given none)."""


def parse_args(ap: argparse.ArgumentParser, smoke: dict[str, Any] | None = None) -> argparse.Namespace:
    """Parse with ``--smoke`` and ``--out`` added; under ``--smoke`` the arguments in ``smoke`` are
    replaced by its toy values (everything else runs as given: the same code path, smaller)."""
    ap.add_argument("--smoke", action="store_true",
                    help="seconds on the CPU: the tiny built-in model and toy sizes, the real run's code path (CI)")
    ap.add_argument("--out", default=None, help="folder for the JSON results (default: $OUT, else here)")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(smoke or {})
    return args


def engine_device(args: argparse.Namespace) -> str:
    """The engine's ``device``: the CPU under ``--smoke``, else the engine's choice (a GPU where there is one)."""
    return "cpu" if args.smoke else "auto"


def bench_device(args: argparse.Namespace) -> torch.device:
    """Where a benchmark's own tensors go: the CPU under ``--smoke``, else CUDA where it is available."""
    return torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def model_dir(name: str | None) -> str | None:
    """A checkpoint path: a preset's config.json in a temp dir (dummy weights), a real path,
    or None for Sid's built-in default model."""
    if name not in PRESETS:
        return name
    path = Path(tempfile.gettempdir()) / f"sid-preset-{name}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(PRESETS[name]))
    return str(path)


def workload(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` requests of (random prompt token ids, output length), lengths uniform in [low, high]."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(low, high))], rng.randint(low, high)) for _ in range(n)
    ]


def lognormal_workload(
    n: int, median_prompt: int, median_output: int, sigma: float, max_len: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """``n`` requests whose prompt and output lengths are log-normal (a long tail: most are short,
    a few long), with the given medians and log-space spread, clipped to [4, ``max_len``] and
    [1, ``max_len``]: the shape of real traffic, where the uniform workload has none."""
    rng = random.Random(seed)

    def length(median: int, low: int) -> int:
        return max(low, min(max_len, round(rng.lognormvariate(math.log(median), sigma))))

    return [
        ([rng.randrange(vocab) for _ in range(length(median_prompt, 4))], length(median_output, 1)) for _ in range(n)
    ]


def device_time(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls: CUDA events on a GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    once = _cuda_seconds if device.type == "cuda" else _wall_seconds
    return statistics.median(once(fn) for _ in range(iters))


def _cuda_seconds(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def replayable(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph, as the engine runs its passes: its replay times the GPU
    without launch gaps. On the CPU there are no graphs: ``fn`` itself."""
    if device.type != "cuda":
        return fn
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def load_module(path: str | Path, name: str) -> ModuleType:
    """A Python file loaded as a module of its own name (another revision's or a patched copy
    of a kernel module, beside the tree's own)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json(name: str, data: dict[str, Any], out: str | None) -> Path:
    """Write under ``--out`` or ``$OUT`` (the device tool's folder) or the working directory."""
    folder = Path(out or os.environ.get("OUT") or ".")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)
