"""A plain ``pip install .`` works: a fresh virtual environment with CPU torch, no Triton.

Marked ``install`` (about a minute: a new venv, torch from the machine's wheel, the package's
own dependencies); ``pytest -m "not install"`` leaves it out of a quick loop, CI runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def torch_requirement() -> str:
    """The torch pin of requirements-cpu.txt: the CPU build CI's machine carries (pyproject keeps a range)."""
    lines = (REPO / "requirements-cpu.txt").read_text().splitlines()
    return next(line.strip() for line in lines if line.startswith("torch=="))


def clean_copy(dest: Path) -> Path:
    """The checkout's tracked and unignored files: a clone with the working tree's edits (no .venv, no out/)."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in names:
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.mark.install
def test_plain_pip_install_runs_sid_generate_without_triton(trained_model: Path, tmp_path: Path) -> None:
    from sid import LLM, SamplingParams

    source = clean_copy(tmp_path / "sid")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str | Path) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    run(sys.executable, "-m", "venv", venv)
    pip = (venv / "bin" / "pip", "install", "-q", "--no-compile")
    run(*pip, torch_requirement())
    run(*pip, source)
    probe = run(venv / "bin" / "python", "-c", "import importlib.util; print(importlib.util.find_spec('triton'))")
    assert probe.stdout == "None\n", "a plain install should not need Triton, and this one has it"
    prompt = ("--prompt", "def main(", "--max-tokens", "12")
    proc = run(venv / "bin" / "sid", "generate", "--model", trained_model, *prompt)

    expected = LLM(str(trained_model), num_kv_blocks=32).generate(
        "def main(", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )[0]
    assert proc.stdout == "def main(" + expected.outputs[0].text + "\n"


def test_cuda_without_triton_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import sid.config
    from sid.config import EngineConfig

    monkeypatch.setattr(sid.config, "HAS_TRITON", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cuda", "auto"):
        with pytest.raises(ValueError, match=r"Triton is not installed: pip install 'sid\[gpu\]'"):
            EngineConfig(device=device).torch_device()
