"""`sid repro`, the main job: tokens and logprobs compared bit for bit, said plainly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sid.repro import COMPOSITIONS, ReproRun, TargetResult, compare, format_table, summarize, verdict


def fake_run(
    lane: str, composition: str, *, diverges: int | None = None, drift: float = 0.0, trial: int = 0
) -> ReproRun:
    mode, _, target = lane.partition("_")
    return ReproRun(
        lane=lane, mode=mode, target=target or "greedy", composition=composition, trial=trial,
        output_hash="0123456789abcdef" if diverges is None else "fedcba9876543210", first_divergence=diverges,
        logprobs_bit_equal=drift == 0.0 and diverges is None, max_abs_logprob_diff=drift, num_tokens=8,
        rollbacks=0, recomputed_tokens=0, seconds=0.1, token_ids=[], logprobs=[],
    )


def all_runs(normal_drift: float = 0.0, det_drift: float = 0.0) -> list[ReproRun]:
    runs = []
    for lane in ("normal", "normal_sampled", "deterministic", "deterministic_sampled"):
        drift = normal_drift if lane.startswith("normal") else det_drift
        for name, _ in COMPOSITIONS:
            runs.append(fake_run(lane, name, drift=0.0 if name == "alone" else drift))
    return runs


def test_compare_is_bit_for_bit_and_measures_drift_only_before_the_divergence() -> None:
    ref = TargetResult([5, 6, 7, 8], [-0.5, -1.0, -2.0, -0.25])
    assert compare(TargetResult([5, 6, 7, 8], [-0.5, -1.0, -2.0, -0.25]), ref) == (None, True, 0.0)
    drifted = TargetResult([5, 6, 7, 8], [-0.5, -1.0 + 2**-30, -2.0, -0.25])
    assert compare(drifted, ref) == (None, False, 2**-30)
    flipped = TargetResult([5, 6, 9, 9], [-0.5, -1.25, -3.0, -9.0])
    assert compare(flipped, ref) == (2, False, 0.25)
    signed_zero = TargetResult([5, 6, 7, 8], [-0.5, -0.0, -2.0, -0.25])
    assert compare(signed_zero, TargetResult([5, 6, 7, 8], [-0.5, 0.0, -2.0, -0.25]))[1] is False


def test_summary_counts_logprob_differences_per_lane() -> None:
    runs = all_runs(normal_drift=3e-6)
    runs.append(fake_run("normal", "+7", diverges=5, drift=1e-5, trial=1))
    summary = summarize(runs)
    assert list(summary) == ["normal", "normal_sampled", "deterministic", "deterministic_sampled"]
    normal = summary["normal"]
    assert (normal["runs"], normal["distinct_outputs"], normal["diverged_runs"]) == (7, 2, 1)
    assert normal["logprob_diff_runs"] == 6 and normal["max_abs_logprob_diff"] == 1e-5
    deterministic = summary["deterministic"]
    assert deterministic["logprob_diff_runs"] == 0 and deterministic["max_abs_logprob_diff"] == 0.0


def test_a_run_that_shows_nothing_says_so_plainly() -> None:
    lines = verdict(summarize(all_runs()))
    assert lines[0].startswith("NO BATCH VARIANCE SHOWN") and "demonstrates nothing" in lines[0]
    lines = verdict(summarize(all_runs(normal_drift=3e-6)))
    assert "changed the logprobs of 10 of 12 runs" in lines[0] and "no token flipped" in lines[0]
    assert lines[1].startswith("Deterministic requests: every run matched")
    assert verdict(summarize(all_runs(normal_drift=3e-6, det_drift=1e-7)))[1].startswith("DETERMINISM BROKEN")


def test_table_columns_stay_aligned_for_long_composition_names() -> None:
    lines = format_table(all_runs(normal_drift=3e-6)).splitlines()
    body = [ln for ln in lines if "(trial 0)" in ln]
    assert len(body) == 2 * len(COMPOSITIONS)
    longest = max(len(f"{name} (trial 0)") for name, _ in COMPOSITIONS)
    # Every row's hash column starts at the same place, right after the longest label.
    assert {ln.index("0123456789ab") for ln in body} == {longest + 2}
    assert {ln.index("differ, max 3.0e-06") for ln in body if not ln.startswith("alone")} | {
        ln.index("bit-equal") for ln in body if ln.startswith("alone")
    } == {longest + 2 + len("0123456789ab") + 2 + len("diverges at") + 2}


def test_sid_repro_shows_batch_variance_on_the_cpu(trained_model: Path, tmp_path: Path) -> None:
    """float32 on the CPU: normal requests' logprobs change with the batch, deterministic ones do not."""
    proc = subprocess.run(
        [sys.executable, "-m", "sid", "repro", "--model", str(trained_model), "--trials", "1", "--max-tokens", "8",
         "--long-prompt", "64", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "repro.json").read_text())
    summary = report["summary"]
    assert set(summary) == {"normal", "normal_sampled", "deterministic", "deterministic_sampled"}
    for lane, s in summary.items():
        assert s["runs"] == len(COMPOSITIONS) and {"distinct_outputs", "diverged_runs", "rollbacks"} <= set(s)
        if s["mode"] == "deterministic":
            assert (s["diverged_runs"], s["logprob_diff_runs"], s["max_abs_logprob_diff"]) == (0, 0, 0.0), lane
        else:
            assert s["logprob_diff_runs"] > 0 and s["max_abs_logprob_diff"] > 0, lane
    assert all(isinstance(r["logprobs_bit_equal"], bool) and len(r["logprobs"]) == 8 for r in report["runs"])
    assert report["targets"]["sampled"] == "sampled: temperature 1.0, seed 7"
    assert (tmp_path / "repro.png").stat().st_size > 10_000
    assert "Deterministic requests: every run matched its alone run in every token and logprob bit." in proc.stdout
    assert "NO BATCH VARIANCE" not in proc.stdout
