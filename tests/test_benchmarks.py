"""Every benchmark runs: each ``benchmarks/*.py`` script's ``--smoke`` mode (its own code path at
toy sizes on the CPU) must exit 0 and write its JSON, so a change that breaks a benchmark, or a
new benchmark without ``--smoke``, fails CI instead of rotting until the next GPU session.

The scripts run two at a time (one torch thread each, on CI's two cores); the module's fixture
runs them all once, and each script's test reads its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


@dataclass
class SmokeRun:
    returncode: int
    output: str
    seconds: float
    out: Path


def smoke(script: str, out: Path) -> SmokeRun:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)],
        cwd=out, env=env, capture_output=True, text=True, timeout=300,
    )
    return SmokeRun(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start, out)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SmokeRun]:
    root = tmp_path_factory.mktemp("benchmarks")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SCRIPTS, pool.map(lambda s: smoke(s, root / Path(s).stem), SCRIPTS)))


def test_every_benchmark_is_found() -> None:
    assert {"decode_roofline.py", "throughput.py", "attention.py", "serve.py", "tp_plan.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_run_writes_its_json(script: str, smoke_runs: dict[str, SmokeRun]) -> None:
    run = smoke_runs[script]
    assert run.returncode == 0, f"{script} --smoke exited {run.returncode} ({run.seconds:.0f} s):\n{run.output[-4000:]}"
    written = sorted(run.out.glob("*.json"))
    assert written, f"{script} --smoke wrote no JSON under --out:\n{run.output[-2000:]}"
    for path in written:
        assert json.loads(path.read_text()), f"{path.name} is empty"
