"""The ``sid`` command line, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sid", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_completion(trained_model: Path) -> None:
    from sid import LLM, SamplingParams

    expected = LLM(str(trained_model), num_kv_blocks=32).generate(
        "def main(", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )[0]
    proc = run_cli("generate", "--model", str(trained_model), "--prompt", "def main(", "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "def main(" + expected.outputs[0].text + "\n"


def test_generate_reports_bad_input_clearly(tmp_path: Path) -> None:
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr
    proc = run_cli("generate", "--prompt", "x", "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr
