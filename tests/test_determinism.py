"""Deterministic requests in the windowed canonical lane: identical bits under any batch
composition, strategy and setting.

The windowed lane (speculate, verify, commit, roll back; direct canonical decode; whole
canonical steps) serves deterministic requests where no GEMM path is proven row-invariant
at every row count. On this CPU one is (``sid.runtime.gemm``'s tiled path), so every test
here injects the faults of a machine without one (``windowed_lane`` in conftest): the
engine falls back to the windowed lane with ``M_canon`` = 32. The fast-lane fault makes the
fast lane's numerics depend on the batch strongly enough to flip tokens, so these tests
would fail if deterministic outputs took anything from the fast lane.
``tests/test_ride.py`` covers rows that ride.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sid import LLM, SamplingParams
from sid.engine.inputs import DEFAULT_DETERMINISTIC_SEED
from sid.engine.request import Request
from sid.engine.router import RequestContext, Router, RouterPolicy, Rule
from sid.engine.plan import Demand, PassSizes, ScheduledChunk, StepPlan
from sid.engine.selftest import DeterminismSelfTestError
from sid.repro import GREEDY, Repro, summarize
from sid.runtime.faults import FAULTS

PROMPT = "def fibonacci(n):\n"
CROWD = ["import os\n", "class Node:\n    def __init__(self", "x = [", "# utils\n" * 12, "    for i in range("]


pytestmark = pytest.mark.usefixtures("windowed_lane")


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch):
    """The fast lane's logits get batch-size-dependent noise big enough to flip tokens."""
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
    return FAULTS


def det(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, deterministic=True, **{"temperature": 0.0, **kw})


def fresh_process_output(model: Path, windowed: bool = False, **llm_kwargs: object) -> tuple[list[int], str]:
    """Tokens and fingerprint of ``PROMPT``'s greedy deterministic run in a new interpreter,
    on the windowed lane's faults (``windowed_lane``) if asked."""
    faults = "FAULTS.no_invariant_gemms = True; FAULTS.fast_gemm_tile = 32;" if windowed else ""
    code = (
        f"import json; from sid import LLM, SamplingParams; from sid.runtime.faults import FAULTS; {faults}"
        f"o = LLM({str(model)!r}, **{llm_kwargs!r}).generate({PROMPT!r}, SamplingParams(max_tokens=32, "
        "temperature=0, ignore_eos=True, deterministic=True), use_tqdm=False)[0];"
        "print(json.dumps([o.outputs[0].token_ids, o.fingerprint]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tokens, fingerprint = json.loads(proc.stdout.strip().splitlines()[-1])
    return tokens, fingerprint


def crowd_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10 + 3 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def reference(trained_model: Path) -> dict[str, list[int]]:
    """Deterministic outputs computed alone, with no faults but the windowed lane's."""
    with pytest.MonkeyPatch.context() as patch:  # a module fixture: ``windowed_lane`` is not active yet
        patch.setattr(FAULTS, "no_invariant_gemms", True)
        patch.setattr(FAULTS, "fast_gemm_tile", 32)
        llm = LLM(str(trained_model), num_kv_blocks=512)
        outs = llm.generate(
            [PROMPT, PROMPT, PROMPT], [det(), det(temperature=0.9, top_p=0.95, seed=5), det(logprobs=3)], use_tqdm=False
        )
    return {"greedy": outs[0].outputs[0].token_ids, "seeded": outs[1].outputs[0].token_ids, "logprobs": outs[2]}


def test_repro_six_compositions_three_trials_under_fast_lane_faults(trained_model: Path, faults: object) -> None:
    llm = LLM(str(trained_model))
    runs = Repro(llm.llm_engine, max_tokens=24, trials=3, long_prompt=256, prompt=PROMPT, targets=(GREEDY,)).run()
    summary = summarize(runs)
    assert summary["deterministic"]["runs"] == 18 and summary["deterministic"]["distinct_outputs"] == 1
    assert all(r.first_divergence is None and r.logprobs_bit_equal for r in runs if r.mode == "deterministic")
    assert summary["deterministic"]["max_abs_logprob_diff"] == 0.0
    assert summary["deterministic"]["rollbacks"] > 0  # the faults really hit the proposals
    assert summary["normal"]["distinct_outputs"] > 1  # and really change what the fast lane computes
    assert summary["normal"]["logprob_diff_runs"] >= summary["normal"]["diverged_runs"] > 0


def test_deterministic_output_equals_the_unperturbed_alone_run(
    trained_model: Path, reference: dict, faults: object
) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=512)
    for key, params in (("greedy", det()), ("seeded", det(temperature=0.9, top_p=0.95, seed=5))):
        outs = llm.generate(
            [*CROWD[:2], PROMPT, *CROWD[2:]], [*crowd_params(2), params, *crowd_params(3)], use_tqdm=False
        )
        assert outs[2].outputs[0].token_ids == reference[key], key
        assert outs[2].deterministic and not outs[0].deterministic
        assert outs[2].fingerprint == llm.llm_engine.fingerprint
    normal = llm.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert normal.outputs[0].token_ids != reference["greedy"]  # the fault does reach normal requests
    assert llm.llm_engine.get_stats()["rollbacks"] > 0


def test_logprobs_of_deterministic_requests_are_canonical(trained_model: Path, reference: dict, faults: object) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=512)
    outs = llm.generate([PROMPT, *CROWD], [det(logprobs=3), *crowd_params(len(CROWD))], use_tqdm=False)
    ref = reference["logprobs"].outputs[0]
    assert outs[0].outputs[0].token_ids == ref.token_ids
    assert outs[0].outputs[0].logprobs == ref.logprobs  # bit-identical floats, ranks and top-3 sets


def test_default_seed_is_documented_and_used(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=128)
    a = llm.generate(PROMPT, det(temperature=0.9), use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(PROMPT, det(temperature=0.9, seed=DEFAULT_DETERMINISTIC_SEED), use_tqdm=False)[0]
    assert a == b.outputs[0].token_ids


@pytest.mark.parametrize("strategy", ["speculate", "direct", "whole"])
def test_every_strategy_gives_the_same_bits(
    trained_model: Path, reference: dict, faults: object, strategy: str
) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=512, determinism_strategy=strategy)
    outs = llm.generate(
        [PROMPT, PROMPT, *CROWD], [det(), det(temperature=0.9, top_p=0.95, seed=5), *crowd_params(len(CROWD))],
        use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == reference["greedy"]
    assert outs[1].outputs[0].token_ids == reference["seeded"]
    stats = llm.llm_engine.get_stats()
    assert stats["strategy_choices"][strategy] > 0
    assert sum(stats["strategy_choices"].values()) == stats["strategy_choices"][strategy]


def test_auto_strategy_follows_the_cost_model(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=512)
    sched = llm.llm_engine.scheduler.windowed
    # A GPU-like cost model (passes cost about the same up to M rows) prefers canonical passes;
    # a CPU-like one (cost per row) prefers speculating one row per request in the fast lane.
    from sid.engine.windowed import CPU_COST, GPU_COST

    sched.cost_model = GPU_COST
    # Few rows in all: one canonical pass does everything.
    assert sched.choose_strategy(fast_rows=20, required_rows=0, num_flexible=4, flexible_rows=4) == "whole"
    # A busy fast lane and no canonical pass due: speculating avoids a pass this step.
    assert sched.choose_strategy(fast_rows=200, required_rows=0, num_flexible=4, flexible_rows=4) == "speculate"
    # A canonical pass runs anyway: decoding directly in its spare rows is free...
    assert sched.choose_strategy(fast_rows=250, required_rows=10, num_flexible=4, flexible_rows=4) == "direct"
    # ...unless the whole step fits one canonical pass with little padding (256 rows here).
    assert sched.choose_strategy(fast_rows=200, required_rows=10, num_flexible=4, flexible_rows=4) == "whole"
    sched.cost_model = CPU_COST
    assert sched.choose_strategy(fast_rows=20, required_rows=0, num_flexible=2, flexible_rows=2) == "speculate"


def test_canonical_rows_are_packed_into_the_fewest_passes_of_checked_sizes(trained_model: Path) -> None:
    sizes = PassSizes.grid(32, 300)
    assert sizes.sizes == (32, 64, 128, 256) and sizes.fit(1) == 32 and sizes.fit(33) == 64
    with pytest.raises(RuntimeError, match="exceeds the largest size"):
        sizes.fit(257)
    fine = PassSizes.grid(128, 2048, per_octave=8)
    assert fine.sizes[:10] == (*range(128, 272, 16), 288) and fine.sizes[-3:] == (1792, 1920, 2048)
    assert fine.fit(130) == 144 and fine.fit(257) == 288 and fine.fit(1000) == 1024 and len(fine.sizes) == 33
    assert PassSizes.grid(1, 40, per_octave=8, cover=True).sizes == (*range(1, 16), *range(16, 32, 2), 32, 36, 40)
    assert PassSizes.grid(1, 41, per_octave=8, cover=True).sizes[-2:] == (40, 44)  # the first size above 41 too
    with pytest.raises(ValueError, match="max_canonical_rows"):
        LLM(str(trained_model), num_kv_blocks=64, max_canonical_rows=16)
    with pytest.raises(ValueError, match="canonical_sizes_per_octave"):
        LLM(str(trained_model), num_kv_blocks=64, canonical_sizes_per_octave=0)
    sched = LLM(str(trained_model), num_kv_blocks=64).llm_engine.scheduler.windowed
    assert sched.canonical.sizes == (32, 64, 128, 256)
    prompt = Request("r", None, list(range(300)), det(), 0, 1, frozenset(), 0, deterministic=True)
    before = replace(sched.stats)
    passes = sched.pack([ScheduledChunk(prompt, 0, 290), ScheduledChunk(prompt, 290, 10)])
    assert [sum(c.num_tokens for c in p) for p in passes] == [256, 44]  # run as passes of 256 and 64 rows
    assert [(c.start, c.end) for p in passes for c in p] == [(0, 256), (256, 290), (290, 300)]
    assert sched.stats.canonical_passes - before.canonical_passes == 2
    assert sched.stats.canonical_rows_padded - before.canonical_rows_padded == 20


def test_speculating_requests_ride_in_the_padding_of_a_canonical_pass(trained_model: Path) -> None:
    sched = LLM(str(trained_model), num_kv_blocks=64, determinism_strategy="speculate").llm_engine.scheduler.windowed
    a, b, c, d = (Request(n, None, list(range(40)), det(), 0, 1, frozenset(), 0, deterministic=True) for n in "abcd")
    verifying = Demand(canonical=ScheduledChunk(a, 0, 20), required=True)  # one 32-row pass: 12 rows spare
    flexible = [Demand(ScheduledChunk(r, 30, n), ScheduledChunk(r, 39, 1)) for r, n in ((b, 5), (c, 9), (d, 4))]
    plan = StepPlan()
    sched.assign(plan, [verifying, *flexible])
    assert [(ch.request.request_id, ch.num_tokens) for ch in plan.canonical[0]] == [("a", 20), ("b", 5), ("d", 4)]
    assert [(ch.request.request_id, ch.num_tokens) for ch in plan.fast] == [("c", 1)]
    assert plan.strategy == "speculate" and len(plan.canonical) == 1


def test_canonical_prefix_blocks_are_reused_and_fast_blocks_never_read(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=256)
    prompt = "import numpy as np\n" * 12 + PROMPT
    fast = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert fast.num_cached_tokens == 0
    first = llm.generate(prompt, det(8), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # the fast request's blocks are not in its domain
    second = llm.generate(prompt, det(8), use_tqdm=False)[0]
    assert second.num_cached_tokens >= 48  # canonical blocks from the first deterministic run
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    cold = LLM(str(trained_model), num_kv_blocks=256, enable_prefix_caching=False)
    assert cold.generate(prompt, det(8), use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_mid_window_keeps_the_output(trained_model: Path, reference: dict, faults: object) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=20, block_size=8, verify_window=8, determinism_strategy="speculate")
    scheduler = llm.llm_engine.scheduler
    preempted_with_proposals = []
    original = scheduler._preempt

    def recording(request):  # noqa: ANN001, ANN202 - wraps the scheduler's own method
        if request.deterministic:
            preempted_with_proposals.append(request.num_proposals)
        original(request)

    scheduler._preempt = recording  # type: ignore[method-assign]
    long_crowd = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate([*CROWD[:4], PROMPT], [*long_crowd, det()], use_tqdm=False)  # arriving last: first victim
    assert any(k > 0 for k in preempted_with_proposals), preempted_with_proposals
    assert outs[4].outputs[0].token_ids == reference["greedy"]
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs[:4])


def test_broken_row_independence_makes_the_self_test_refuse(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FAULTS, "canonical_cross_row", 1e-3)
    with pytest.raises(DeterminismSelfTestError, match="not independent on this machine"):
        LLM(str(trained_model), num_kv_blocks=64)
    llm = LLM(str(trained_model), num_kv_blocks=64, enable_determinism=False)  # the fast lane still serves
    with pytest.raises(ValueError, match="enable_determinism"):
        llm.generate(PROMPT, det(), use_tqdm=False)


def test_a_pass_size_that_changes_bits_is_dropped(
    trained_model: Path, reference: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(FAULTS, "broken_pass_size", 64)
    with caplog.at_level(logging.WARNING, logger="sid.engine.selftest"):
        llm = LLM(str(trained_model), num_kv_blocks=64)
    assert llm.llm_engine.canonical.sizes == (32, 128, 256)
    assert llm.llm_engine.get_stats()["canonical_pass_sizes"] == [32, 128, 256]
    assert "canonical passes of 64 rows are not used" in caplog.text
    assert llm.generate(PROMPT, det(), use_tqdm=False)[0].outputs[0].token_ids == reference["greedy"]


def test_large_canonical_passes_give_the_bits_of_small_ones(trained_model: Path, faults: object) -> None:
    """Long prompts and whole steps run in passes of up to 256 rows (LM head on the rows that
    choose a token, prompt logprobs included) or only in passes of M_canon = 32: same bits."""
    long = "import numpy as np\n" * 25 + PROMPT
    prompts = [long, long + "    return", *CROWD[:4]]
    params = [det(24, logprobs=2, prompt_logprobs=1), det(24, temperature=0.9, seed=3), *crowd_params(4)]
    seen, passes = [], []
    for largest in (32, 256):
        llm = LLM(str(trained_model), num_kv_blocks=512, max_canonical_rows=largest, determinism_strategy="whole")
        assert llm.llm_engine.canonical.max == largest
        outs = llm.generate(prompts, params, use_tqdm=False)
        seen.append(
            [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs, o.fingerprint) for o in outs[:2]]
        )
        passes.append(llm.llm_engine.get_stats()["canonical_passes"])
    assert seen[0] == seen[1]
    assert len(seen[0][0][2]) > 4 * 32  # the long prompt's logprobs came from the large passes too
    assert passes[1] < passes[0]  # and the large passes really ran


def test_pass_sizes_beyond_the_model_length_are_checked_on_several_filler_sequences(
    trained_model: Path, reference: dict
) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=128, max_model_len=100)
    assert llm.llm_engine.canonical.sizes == (32, 64, 128, 256)  # a 256-row pass holds 3 sequences of <= 99
    assert llm.generate(PROMPT, det(), use_tqdm=False)[0].outputs[0].token_ids == reference["greedy"]


SETTINGS = [
    dict(num_kv_blocks=96),
    dict(max_num_seqs=2),
    dict(enable_prefix_caching=False),
    dict(enforce_eager=True),
    dict(verify_window=3),
    dict(max_num_batched_tokens=7),
    dict(block_size=8),
    dict(async_scheduling=True),
    dict(max_canonical_rows=32),
    dict(canonical_sizes_per_octave=8),
]


def test_same_bits_under_other_settings_and_in_a_fresh_process(trained_model: Path, reference: dict) -> None:
    fingerprints = set()
    for settings in SETTINGS:
        llm = LLM(str(trained_model), **settings)
        outs = llm.generate([PROMPT, *CROWD[:3]], [det(), *crowd_params(3)], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == reference["greedy"], settings
        fingerprints.add(outs[0].fingerprint)
    assert len(fingerprints) == 1
    tokens, fingerprint = fresh_process_output(trained_model, windowed=True)
    assert tokens == reference["greedy"] and fingerprint in fingerprints


def test_fingerprint_changes_with_the_numerics(trained_model: Path) -> None:
    base = LLM(str(trained_model), num_kv_blocks=64).llm_engine.fingerprint
    assert LLM(str(trained_model), num_kv_blocks=64, canonical_rows=16).llm_engine.fingerprint != base
    assert LLM(str(trained_model), num_kv_blocks=64, dtype="bfloat16").llm_engine.fingerprint != base


def test_router_precedence() -> None:
    policy = RouterPolicy(
        rules=(
            Rule(deterministic=True, api_key="audit"), Rule(deterministic=True, seeded=True),
            Rule(deterministic=False, user="bulk")
        ),
        default=False,
    )
    router = Router(policy)
    plain = SamplingParams()
    assert router.decide(plain) == (False, "default")
    assert router.decide(plain, RequestContext(api_key="audit")) == (True, "rule:0")
    assert router.decide(SamplingParams(seed=1), RequestContext(user="bulk")) == (True, "rule:1")
    assert router.decide(SamplingParams(deterministic=False), RequestContext(api_key="audit")) == (False, "field")
    assert router.decide(plain, RequestContext(api_key="audit", header=False)) == (False, "header")
    assert Router(RouterPolicy(default=True)).decide(plain) == (True, "default")
    with pytest.raises(ValueError, match="router rule 0"):
        RouterPolicy.from_dict({"rules": [{"deterministic": True, "colour": "red"}]})


def test_router_policy_routes_engine_requests(trained_model: Path, tmp_path: Path) -> None:
    policy = tmp_path / "router.json"
    policy.write_text(json.dumps({"rules": [{"deterministic": True, "greedy": True}], "default": False}))
    llm = LLM(str(trained_model), num_kv_blocks=64, router_policy=str(policy))
    greedy, sampled = llm.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=4)], use_tqdm=False
    )
    assert greedy.deterministic and not sampled.deterministic
