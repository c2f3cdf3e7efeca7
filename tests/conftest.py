"""Test set-up: Triton runs in its interpreter when there is no GPU (CI is CPU-only)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
from pathlib import Path

import pytest

from sid.model.builtin import train_tokenizer, trained_model_path, write_checkpoint

FAMILIES = {
    # Llama: untied, GQA, Llama 3.1 rope scaling.
    "llama": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Mistral: MQA (one KV head).
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None)),
    # Qwen2: qkv bias, tied embeddings.
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Qwen3: q/k norm and an explicit head_dim different from hidden / heads.
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """One tiny random-weight checkpoint per family, sharing one trained tokenizer."""
    out = {}
    for family, (arch, overrides) in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        write_checkpoint(path, arch, seed=len(out), tokenizer=False, **overrides)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, path / f.name)
        out[family] = path
    return out


@pytest.fixture(scope="session")
def trained_model() -> Path:
    """The shared trained model; a missing one fails the test (CI has ../shared beside the clone)."""
    path = trained_model_path()
    assert path is not None, "the trained test model ../shared/models/tiny-pycode-llama is missing"
    return path


@pytest.fixture
def windowed_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GEMM path proves row-invariant, so deterministic requests take the windowed canonical
    lane, on a machine whose GEMMs keep a row's bits from 32 rows on (tiles of 32): its pass
    sizes then do not depend on how the CPU running the tests rounds."""
    from sid.runtime.faults import FAULTS

    monkeypatch.setattr(FAULTS, "no_invariant_gemms", True)
    monkeypatch.setattr(FAULTS, "fast_gemm_tile", 32)
