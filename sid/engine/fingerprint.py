"""The numerics fingerprint (DESIGN 3.2): same fingerprint + same request => same bits.

It hashes everything that fixes the canonical numerics: the GEMM path of every weight shape
(where they are proven row-invariant at every row count; otherwise the GEMM library and the
canonical row count), dtype, tensor-parallel size (unless TP-invariant sums hold a row's bits
at every TP size they cover), the attention backend's fixed constants,
the source of every module on the numerics path, library versions, the processor (GPU model,
or CPU model, ISA and thread count) and a digest of the weights. Engine settings that must
*not* matter (KV pool size, max_num_seqs, prefix caching, CUDA graphs, verify window, chunk
sizes, pass sizes, the determinism strategy, the padding of small GEMMs: the self-test
checks that pass sizes and company leave a row's bits alone) stay out.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

if TYPE_CHECKING:
    from sid.engine.engine import LLMEngine

_NUMERICS_SOURCES = (
    "kernels",
    "model/decoder.py",
    "model/layers.py",
    "runtime/attention.py",
    "runtime/gemm.py",
    "runtime/distributed.py",
    "runtime/model_runner.py",
    "runtime/sampler.py",
    "runtime/triton_backend.py",
)


def source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = xxhash.xxh3_128()
    for rel in _NUMERICS_SOURCES:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def weights_digest(model_dir: Path, load_format: str, seed: int, tp_size: int) -> str:
    """Digest of the weight files' bytes (or of the config, seed and TP size for dummy weights,
    which each rank draws for itself: another TP size is another random model)."""
    h = xxhash.xxh3_128()
    if load_format == "dummy":
        h.update(f"dummy:{seed}:{tp_size}:".encode())
        h.update((model_dir / "config.json").read_bytes())
        return h.hexdigest()
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def processor(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")),
            model
        )
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def numerics_config(engine: LLMEngine) -> dict[str, Any]:
    """Everything of a built engine that fixes canonical bits (DESIGN 3.2)."""
    from sid.kernels import triton_version

    config, gemms = engine.config, engine.model.gemms
    # With TP-invariant sums on paths that every TP size shares, a row's bits are those of every
    # TP size the chunks cover: a receipt replays at any of them.
    paths: dict[str, str] | str = str(gemms.fast)
    if gemms.tp_free is not None:
        paths = gemms.tp_free
    elif gemms.invariant is not None:
        paths = gemms.describe()
    return {
        # Rows keep their bits at every pass size under proven GEMMs, so M_canon fixes no bits then.
        "canonical_rows": None if gemms.invariant is not None else engine.canonical_rows,
        "gemms": paths,
        "dtype": str(engine.dtype),
        "tensor_parallel_size": None if gemms.tp_free is not None else config.tensor_parallel_size,
        "tp_invariant_chunks": config.tp_invariant_chunks,
        "attention": engine.backend.canonical_config(),
        "sources": source_digest(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "processor": processor(engine.device),
        "weights": weights_digest(engine.path, config.load_format, config.seed, config.tensor_parallel_size),
        "architecture": engine.model_config.architecture,
    }


def numerics_fingerprint(config: dict[str, Any]) -> str:
    """``fp_`` + 16 hex digits over the canonical sort of ``config``."""
    return "fp_" + xxhash.xxh3_64_hexdigest(json.dumps(config, sort_keys=True, default=str).encode())
