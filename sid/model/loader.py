"""Build a ``CausalLM`` and fill it from safetensors shards (or with dummy weights).

Hugging Face checkpoints store q/k/v and gate/up separately; Sid merges them into one
projection each, so the loader maps every stored tensor to a (parameter, row offset) and
checks that every expected tensor was read. Under tensor parallelism a rank reads only
its slice of each split tensor (``safetensors`` slices, not whole tensors).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sid.model.config import CheckpointError, ModelConfig
from sid.model.decoder import CausalLM, TensorParallel

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class _Slot:
    """Where one stored tensor goes: its part ``start : start + length`` along ``dim`` (all of
    it when ``dim`` is None) fills rows from ``offset`` of ``param``."""

    param: str
    offset: int
    shape: tuple[int, ...]
    """The stored (whole) tensor's shape."""
    dim: int | None = None
    start: int = 0
    length: int = 0


def _expected_tensors(model: CausalLM) -> dict[str, _Slot]:
    """Every tensor a Hugging Face checkpoint of this config must hold, by its stored name,
    with this rank's part of it."""
    cfg, shard = model.cfg, model.shard
    # Stored rows of each split tensor, and (first row, rows) of this rank's part.
    q = (cfg.q_size, shard.rank * shard.q_size, shard.q_size)
    kv = (cfg.kv_size, shard.kv_head_start * cfg.head_dim, shard.kv_size)
    mlp = (cfg.intermediate_size, shard.rank * shard.intermediate_size, shard.intermediate_size)
    vocab_rows = max(0, min(shard.vocab_rows, cfg.vocab_size - shard.vocab_start))
    vocab = (cfg.vocab_size, shard.vocab_start, vocab_rows)
    merged_parts = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    split_inputs = {"self_attn.o_proj": q, "mlp.down_proj": mlp}
    split_rows = {"embed_tokens": vocab, "lm_head": vocab}
    out: dict[str, _Slot] = {}
    for name, param in model.named_parameters():
        hf_prefix = "" if name.startswith("lm_head.") else "model."
        merged = next((m for m in _MERGED if f".{m}." in name), None)
        split_in = next((m for m in split_inputs if f".{m}." in name), None)
        split_row = split_rows.get(name.split(".")[0])
        if merged is not None:
            offset = 0
            for part in _MERGED[merged]:
                n, start, length = merged_parts[part.split(".")[-1]]
                hf_name = hf_prefix + name.replace(f".{merged}.", f".{part}.")
                out[hf_name] = _Slot(name, offset, (n, *param.shape[1:]), 0, start, length)
                offset += length
        elif split_in is not None:
            n, start, length = split_inputs[split_in]
            out[hf_prefix + name] = _Slot(name, 0, (param.shape[0], n), 1, start, length)
        elif split_row is not None:
            n, start, length = split_row
            out[hf_prefix + name] = _Slot(name, 0, (n, *param.shape[1:]), 0, start, length)
        else:
            out[hf_prefix + name] = _Slot(name, 0, tuple(param.shape))
    return out


def _read(f: safe_open, hf_name: str, slot: _Slot, file: Path) -> torch.Tensor:
    """This rank's part of a stored tensor, after checking the whole tensor's shape."""
    part = f.get_slice(hf_name)
    shape = tuple(part.get_shape())
    if shape != slot.shape:
        raise CheckpointError(
            f"weight {hf_name} in {file.name} has shape {shape}, but the config implies {slot.shape}"
        )
    if slot.dim is None:
        return f.get_tensor(hf_name)
    index = [slice(None)] * len(shape)
    index[slot.dim] = slice(slot.start, slot.start + slot.length)
    return part[tuple(index)]


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
                tensor = _read(f, hf_name, slot, file)
                with torch.no_grad():
                    params[slot.param][slot.offset : slot.offset + tensor.shape[0]].copy_(tensor)
                loaded.add(hf_name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights: {', '.join(missing[:8])}{more}")


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of the right shapes (normal, std 0.02; norms at 1), for performance work.

    Rank ``r`` of a tensor-parallel group draws its own shard from ``seed + r``: a random
    model of the same shape, not a slice of the single-rank one (nothing random is replicated).
    """
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed + model.shard.rank)
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
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Construct the model (this rank's shard under ``tp``) on ``device`` in ``dtype`` and load its weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions, tp)
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
