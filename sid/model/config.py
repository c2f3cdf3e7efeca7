"""Model configuration read from a Hugging Face ``config.json``.

One decoder serves every supported family; this module turns each family's config into
the switches that decoder needs and rejects what it cannot run, with a clear message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class CheckpointError(ValueError):
    """A model directory or weight file that cannot be served."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (``rope_type`` ``default`` or ``llama3``)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class HeadLayout:
    """Widths of the q and k/v projections of a head layout (a model's, or one rank's)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig(HeadLayout):
    """Shape and switches of a decoder-only transformer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {arch!r} in config.json; Sid serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            vocab_size = int(cfg["vocab_size"])
            intermediate = int(cfg["intermediate_size"])
            num_layers = int(cfg["num_hidden_layers"])
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required field {exc.args[0]!r}") from None
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if cfg.get("mlp_bias"):
            raise CheckpointError("mlp_bias=true is not implemented")
        head_dim = cfg.get("head_dim") or hidden // num_heads
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        if sliding is not None and int(sliding) < max_pos:
            # Attention never spans more than the window when sequences are capped at it.
            max_pos = int(sliding)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(cfg),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"model path {str(path)!r} is not a directory")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{str(path)!r} is not a Hugging Face checkpoint: no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
        return cls.from_dict(cfg)


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise CheckpointError(f"unsupported rope type {rope_type!r}; Sid implements 'default' and 'llama3'")
