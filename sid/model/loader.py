"""Build a ``CausalLM`` and fill it from safetensors shards (or with dummy weights).

Hugging Face checkpoints store q/k/v and gate/up separately; Sid merges them into one
projection each, so the loader maps every stored tensor to a (parameter, row offset) and
checks that every row of every parameter was written exactly once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sid.model.config import CheckpointError, ModelConfig
from sid.model.decoder import CausalLM

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class _Slot:
    """Where one stored tensor goes: rows ``offset : offset + shape[0]`` of ``param``."""

    param: str
    offset: int
    shape: tuple[int, ...]


def _expected_tensors(model: CausalLM) -> dict[str, _Slot]:
    """Every tensor a Hugging Face checkpoint of this config must hold, by its stored name."""
    cfg = model.cfg
    rows = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size}
    rows |= {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    out: dict[str, _Slot] = {}
    for name, param in model.named_parameters():
        hf_prefix = "" if name.startswith("lm_head.") else "model."
        merged = next((m for m in _MERGED if f".{m}." in name), None)
        if merged is None:
            out[hf_prefix + name] = _Slot(name, 0, tuple(param.shape))
            continue
        offset = 0
        for part in _MERGED[merged]:
            n = rows[part.split(".")[-1]]
            hf_name = hf_prefix + name.replace(f".{merged}.", f".{part}.")
            out[hf_name] = _Slot(name, offset, (n, *param.shape[1:]))
            offset += n
    return out


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
    expected = _expected_tensors(model)
    loaded: set[str] = set()
    for file in _weight_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read weight file {file.name}: {exc}") from None
        with handle as f:
            for hf_name in f.keys():
                slot = expected.get(hf_name)
                if slot is None:
                    tied_head = model.cfg.tie_word_embeddings and hf_name == "lm_head.weight"
                    if not (tied_head or hf_name.endswith(IGNORED_SUFFIXES)):
                        logger.warning("ignoring unexpected tensor %s in %s", hf_name, file.name)
                    continue
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != slot.shape:
                    raise CheckpointError(
                        f"weight {hf_name} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"but the config implies {slot.shape}"
                    )
                with torch.no_grad():
                    params[slot.param][slot.offset : slot.offset + slot.shape[0]].copy_(tensor)
                loaded.add(hf_name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights: {', '.join(missing[:8])}{more}")


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
