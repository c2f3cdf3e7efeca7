"""Shared pieces of the benchmarks: real model shapes for dummy weights, the workload, output."""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
}


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


def cuda_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on the GPU, timed with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
