"""The ``sid`` command line, run as a user would."""

from __future__ import annotations

import argparse
import json
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


def test_generate_takes_every_determinism_strategy(trained_model: Path) -> None:
    """Each strategy the engine knows is a choice on the command line; ``ride`` (bf16 on the CPU,
    where the GEMMs prove row-invariant) gives the deterministic tokens the Python API gives."""
    from sid import LLM, SamplingParams
    from sid.engine.plan import STRATEGIES

    expected = LLM(str(trained_model), dtype="bfloat16", num_kv_blocks=32, determinism_strategy="ride").generate(
        "def main(", SamplingParams(max_tokens=8, temperature=0, deterministic=True), use_tqdm=False
    )[0]
    argv = [
        "generate", "--model", str(trained_model), "--dtype", "bfloat16", "--deterministic", "--prompt", "def main("
    ]
    proc = run_cli(*argv, "--max-tokens", "8", "--determinism-strategy", "ride")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "def main(" + expected.outputs[0].text + "\n"
    unknown = run_cli(*argv, "--determinism-strategy", "fastest")
    assert unknown.returncode == 2
    assert "invalid choice: 'fastest'" in unknown.stderr and all(name in unknown.stderr for name in STRATEGIES)


def test_generate_reports_bad_input_clearly(tmp_path: Path) -> None:
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr
    proc = run_cli("generate", "--prompt", "x", "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr


def test_receipts_replay_match_and_refuse(trained_model: Path, tmp_path: Path) -> None:
    import json

    from sid.receipts import token_hash

    receipts = tmp_path / "receipts.jsonl"
    proc = run_cli(
        "generate", "--model", str(trained_model), "--prompt", "def main(", "--prompt", "import os",
        "--max-tokens", "12", "--temperature", "0.7", "--deterministic", "--receipts", str(receipts),
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in receipts.read_text().splitlines()]
    assert len(records) == 2 and all(r["params"]["seed"] == 0 for r in records)
    assert f"fingerprint {records[0]['fingerprint']}" in proc.stderr
    proc = run_cli("replay", str(receipts), "--model", str(trained_model))
    assert proc.returncode == 0 and proc.stdout.count("MATCH") == 2, proc.stdout + proc.stderr

    tampered = dict(records[0])
    tampered["output_token_ids"] = list(tampered["output_token_ids"])
    tampered["output_token_ids"][5] += 1
    tampered["output_hash"] = token_hash(tampered["output_token_ids"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(tampered) + "\n")
    proc = run_cli("replay", str(bad), "--model", str(trained_model))
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout and "first divergence at token 5" in proc.stdout

    other = dict(records[1], fingerprint="fp_0123456789abcdef")
    bad.write_text(json.dumps(other) + "\n")
    proc = run_cli("replay", str(bad), "--model", str(trained_model))
    assert proc.returncode == 2 and "differs from this engine's" in proc.stderr


def test_deterministic_default_turns_the_router_policy_default_on(tmp_path: Path) -> None:
    from sid.entrypoints.cli import serve_router_policy

    policy = tmp_path / "router.json"
    policy.write_text(json.dumps({"rules": [{"user": "bulk", "deterministic": False}]}))
    args = argparse.Namespace(router_config=str(policy), deterministic_default=True)
    on = serve_router_policy(args)
    assert on.default and on.rules[0].user == "bulk"  # the rules stay, and still win
    assert not serve_router_policy(argparse.Namespace(router_config=None, deterministic_default=False)).default
