"""Build a ``CausalLM`` and fill it from safetensors shards (or with dummy weights).

Hugging Face checkpoints store q/k/v and gate/up separately; Sid merges them into one
projection each, so the loader maps every stored tensor to a (parameter, row offset) and
checks that every row of every parameter was written exactly once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from sid.model.config import CheckpointError, ModelConfig
from sid.model.decoder import CausalLM

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _ignored(cfg: ModelConfig, hf_name: str) -> bool:
    """Tensors a checkpoint may carry that Sid does not need."""
    return hf_name.endswith(IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and hf_name == "lm_head.weight")


def _target(cfg: ModelConfig, name: str) -> tuple[str, int]:
    """Map a Hugging Face tensor name to (Sid parameter name, row offset)."""
    name = name.removeprefix("model.")
    merged = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", cfg.q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", cfg.q_size + cfg.kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", cfg.intermediate_size),
    }
    for hf, (sid, offset) in merged.items():
        marker = f".{hf}."
        if marker in name:
            return name.replace(marker, f".{sid}."), offset
    return name, 0


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"weight shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} has no *.safetensors weight files")
    return files


def load_weights(model: CausalLM, path: Path) -> None:
    """Copy every checkpoint tensor into ``model``; raise naming any missing or misshapen one."""
    params = dict(model.named_parameters())
    rows_written = {name: 0 for name in params}
    for file in _weight_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read weight file {file.name}: {exc}") from None
        with handle as f:
            for hf_name in f.keys():
                if _ignored(model.cfg, hf_name):
                    continue
                name, offset = _target(model.cfg, hf_name)
                if name not in params:
                    logger.warning("ignoring unexpected tensor %s in %s", hf_name, file.name)
                    continue
                tensor = f.get_tensor(hf_name)
                param = params[name]
                rows = tensor.shape[0] if tensor.dim() else 0
                expected = (rows, *param.shape[1:]) if param.dim() else ()
                if tuple(tensor.shape) != tuple(expected) or offset + rows > (param.shape[0] if param.dim() else 0):
                    raise CheckpointError(
                        f"weight {hf_name} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"but the config implies {_expected_shape(model.cfg, hf_name, param, offset)}"
                    )
                with torch.no_grad():
                    param[offset : offset + rows].copy_(tensor)
                rows_written[name] += rows
    missing = [name for name, p in params.items() if rows_written[name] != p.shape[0]]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(sorted(missing)[:8])}")


def _expected_shape(cfg: ModelConfig, hf_name: str, param: torch.Tensor, offset: int) -> tuple[int, ...]:
    """The stored shape a tensor should have, for error messages."""
    rows = {
        "q_proj": cfg.q_size,
        "k_proj": cfg.kv_size,
        "v_proj": cfg.kv_size,
        "gate_proj": cfg.intermediate_size,
        "up_proj": cfg.intermediate_size,
    }
    for key, n in rows.items():
        if f".{key}." in hf_name:
            return (n, *param.shape[1:])
    return tuple(param.shape)


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of the right shapes (normal, std 0.02; norms at 1), for performance work."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def build_model(
    cfg: ModelConfig,
    path: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> CausalLM:
    """Construct the model directly on ``device`` in ``dtype`` and load its weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format in ("auto", "safetensors"):
        if path is None:
            raise CheckpointError("a model path is required unless load_format='dummy'")
        load_weights(model, path)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; use 'auto', 'safetensors' or 'dummy'")
    return model.eval().requires_grad_(False)
