"""The scheduler's pass costs: measured at start-up on a GPU, and what they make it choose."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from sid import LLM, SamplingParams
from sid.engine.calibrate import measure_pass_costs, warm_up
from sid.engine.request import Request
from sid.engine.plan import Demand, ScheduledChunk, StepPlan
from sid.engine.windowed import MeasuredPassCost


pytestmark = pytest.mark.usefixtures("windowed_lane")

def test_measured_costs_interpolate_between_the_timed_passes() -> None:
    cost = MeasuredPassCost(
        fast_graphed=((1, 2.0), (16, 2.0), (256, 8.0)), fast_eager=((16, 20.0),),
        canonical_eager=((128, 4.0), (256, 6.0))
    )
    assert cost.fast(0, True) == 0.0
    assert cost.fast(1, True) == cost.fast(8, True) == 2.0
    assert cost.fast(136, True) == pytest.approx(5.0)
    assert cost.fast(496, True) == pytest.approx(14.0)  # past the last point, along the last segment
    assert cost.fast(4096, False) == 20.0  # one point: that pass's cost at every size
    assert cost.canonical(64, False) == 4.0 and cost.canonical(192, False) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="no pass of this kind was timed"):
        cost.canonical(128, True)


def test_a_whole_step_keeps_prompt_chunks_fast_only_where_a_pass_more_is_cheaper(trained_model: Path) -> None:
    """A launch-bound model (every eager pass costs about the same) runs a whole step as one
    canonical pass; a row-bound one leaves other requests' prompt chunks in the fast lane."""
    sched = LLM(str(trained_model), num_kv_blocks=64, determinism_strategy="whole").llm_engine.scheduler.windowed
    assert sched.canonical.sizes == (32, 64, 128, 256) and sched.graph_rows == 0
    flexible = Request(
        "d", None, list(range(40)), SamplingParams(max_tokens=8), 0, 1, frozenset(), 0, deterministic=True
    )
    decoding = Request("f", None, list(range(40)), SamplingParams(max_tokens=8), 0, 1, frozenset(), 0)
    prompt = Request("p", None, list(range(100)), SamplingParams(max_tokens=8), 0, 1, frozenset(), 0)

    def plan_for(prompt_rows: int) -> StepPlan:
        plan = StepPlan()
        demands = [
            Demand(ScheduledChunk(flexible, 39, 1), ScheduledChunk(flexible, 39, 1)),
            Demand(fast=ScheduledChunk(decoding, 39, 1)),
            Demand(fast=ScheduledChunk(prompt, 0, prompt_rows)),
        ]
        sched.assign(plan, demands)
        assert plan.strategy == "whole"
        return plan

    sched.cost_model = MeasuredPassCost(
        fast_eager=((16, 20.0), (4096, 25.0)), canonical_eager=((32, 21.0), (256, 22.0))
    )
    launch_bound = plan_for(90)
    assert launch_bound.fast == [] and sorted(c.request.request_id for c in launch_bound.canonical[0]) == [
        "d", "f", "p"
    ]
    sched.cost_model = MeasuredPassCost(fast_eager=((16, 1.6), (4096, 409.6)), canonical_eager=((32, 3.4), (256, 27.0)))
    row_bound = plan_for(90)  # 92 rows: a 32-row canonical pass beside the prompt beats a 128-row one
    assert [c.request.request_id for c in row_bound.fast] == ["p"]
    assert sorted(c.request.request_id for p in row_bound.canonical for c in p) == ["d", "f"]
    assert plan_for(40).fast == []  # 42 rows: one 64-row canonical pass costs less than a fast one beside it


def test_a_decode_graph_makes_speculating_cheaper_than_an_eager_whole_step(trained_model: Path) -> None:
    sched = LLM(str(trained_model), num_kv_blocks=64).llm_engine.scheduler.windowed
    sched.cost_model = MeasuredPassCost(
        fast_graphed=((1, 1.0), (64, 2.0)), fast_eager=((16, 20.0),), canonical_eager=((32, 21.0), (256, 22.0))
    )
    sched.fast_graph_rows = 64
    # 60 decode rows and 4 flexible ones: whole = one eager canonical pass; speculating = a
    # graphed fast step and an eighth of an eager verification pass.
    assert sched.choose_strategy(fast_rows=60, required_rows=0, num_flexible=4, flexible_rows=4) == "speculate"
    sched.fast_graph_rows = 0  # no decode graphs: the fast step is an eager pass too
    assert sched.choose_strategy(fast_rows=60, required_rows=0, num_flexible=4, flexible_rows=4) == "whole"


def test_start_up_timing_covers_every_kind_of_pass_and_gives_the_blocks_back(trained_model: Path) -> None:
    engine = LLM(str(trained_model), num_kv_blocks=128).llm_engine
    free = engine.kv.pool.num_free
    cost = measure_pass_costs(
        engine.runner, engine.kv, engine.canonical_domain, fast_graph_rows=0, graph_rows=64, max_rows=200, chunk_len=48,
        context=40, repeats=1, launches=2,
    )
    assert cost is not None and engine.kv.pool.num_free == free
    assert cost.fast_graphed == () and [r for r, _ in cost.fast_eager] == [16, 200]
    assert [r for r, _ in cost.canonical_graphed] == [32, 64] and [r for r, _ in cost.canonical_eager] == [128, 256]
    assert all(ms > 0 for table in (cost.fast_eager, cost.canonical_graphed, cost.canonical_eager) for _, ms in table)
    # A pool too small for the largest pass: nothing is timed and the blocks stay free.
    small = LLM(str(trained_model), num_kv_blocks=16).llm_engine
    assert measure_pass_costs(small.runner, small.kv, small.canonical_domain, fast_graph_rows=0, graph_rows=0,
                              max_rows=256, chunk_len=48, context=8) is None
    assert small.kv.pool.num_free == 16


def test_warm_up_runs_each_prompt_pass_once_and_gives_the_blocks_back(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no pass timing runs (riding rows, determinism off), the engine runs prompt passes
    once at start-up so their kernels compile there, not in the first requests' steps."""
    engine = LLM(str(trained_model), num_kv_blocks=128).llm_engine
    runner, free = engine.runner, engine.kv.pool.num_free
    passes: list[int] = []
    execute = runner.execute
    monkeypatch.setattr(
        runner, "execute",
        lambda chunks, *a, **k: passes.append(sum(c.num_tokens for c in chunks)) or execute(chunks, *a, **k)
    )
    warm_up(runner, engine.kv, engine.canonical_domain, max_rows=300, chunk_len=48)
    assert passes == [16, 256, 300] and engine.kv.pool.num_free == free
    small = LLM(str(trained_model), num_kv_blocks=16).llm_engine
    warm_up(small.runner, small.kv, small.canonical_domain, max_rows=256, chunk_len=48)  # no room: nothing runs
    assert small.kv.pool.num_free == 16


def test_the_engine_freezes_what_is_alive_at_start_up_until_shutdown(trained_model: Path) -> None:
    gc.unfreeze()
    engine = LLM(str(trained_model), num_kv_blocks=64).llm_engine
    assert gc.get_freeze_count() > 0  # the collector no longer scans the model and the libraries
    engine.shutdown()
    assert gc.get_freeze_count() == 0
