"""GPU-only checks of the engine: CUDA graphs (decode and canonical) and determinism in bf16.

CPU twins: the same engine paths run on the CPU in test_engine.py / test_determinism.py,
and every Triton kernel runs under the interpreter in test_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid import LLM, SamplingParams
from sid.engine.plan import ScheduledChunk
from sid.engine.windowed import MeasuredPassCost
from sid.runtime import gemm
from sid.runtime.gemm import shape_of
from tests.test_models import record_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twins run in CI)")

PROMPTS = [
    "def main(", "import numpy as np\n", "class Config:\n    def __init__(self", "    for i in range(", "# test\n"
]


def decoding_engine(trained_model: Path) -> LLM:
    """An engine whose requests have finished their prompts and are decoding."""
    llm = LLM(str(trained_model), max_num_seqs=64, enable_determinism=False, async_scheduling=False)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    return llm


def test_cuda_graph_decode_is_bit_identical_to_eager_at_the_same_padded_batch(trained_model: Path) -> None:
    llm = decoding_engine(trained_model)
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None
    running = engine.scheduler.running
    assert len(running) == len(PROMPTS) and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
    bs = engine.config.block_size
    tables = engine.kv.block_table(running)
    pos = [r.num_tokens - 1 for r in running]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    ids = [r.token_ids[-1] for r in running]
    bucket = graphs.load(ids, pos, slots, tables, [p + 1 for p in pos])
    assert bucket.rows == 8
    replayed = graphs.replay(bucket).clone()
    eager = graphs.forward(bucket)
    assert torch.equal(replayed, eager)
    # The unpadded eager step (exact batch, its own attention schedule) agrees within bf16 noise.
    engine.runner.graphs = None
    seen = record_logits(llm)
    engine.runner.execute([ScheduledChunk(r, r.num_tokens - 1, 1) for r in running], tables)
    unpadded = seen[-1]
    rel = (unpadded - replayed[: len(running)]).norm() / replayed[: len(running)].norm()
    assert rel < 2e-2, rel


def test_deterministic_request_is_identical_alone_and_under_load_in_bf16(trained_model: Path) -> None:
    """Riding in graphed and eager mixed steps, and through every windowed strategy: the same bits."""
    llm = LLM(str(trained_model), gpu_memory_utilization=0.3)
    assert llm.llm_engine.ride, llm.llm_engine.gemm_failures  # the H200 proves a path for every shape
    det = SamplingParams(max_tokens=64, temperature=0, logprobs=2, ignore_eos=True, deterministic=True)
    first = llm.generate(PROMPTS[0], det, use_tqdm=False)[0]
    alone = (first.outputs[0].token_ids, first.outputs[0].logprobs, first.fingerprint)
    crowd = [p * (i + 1) for i, p in enumerate(PROMPTS * 12)]
    params = [SamplingParams(max_tokens=32 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(crowd))]
    outs = llm.generate([*crowd[:30], PROMPTS[0], *crowd[30:]], [*params[:30], det, *params[30:]], use_tqdm=False)
    assert (outs[30].outputs[0].token_ids, outs[30].outputs[0].logprobs, outs[30].fingerprint) == alone
    assert llm.stats()["strategy_choices"]["ride"] > 0 and llm.stats()["verifications"] == 0
    del llm
    windowed = LLM(str(trained_model), determinism_strategy="speculate", gpu_memory_utilization=0.3)
    for strategy in ("speculate", "direct", "whole"):
        windowed.llm_engine.scheduler.windowed.strategy = strategy
        outs = windowed.generate(
            [*crowd[:30], PROMPTS[0], *crowd[30:]], [*params[:30], det, *params[30:]], use_tqdm=False
        )
        assert (outs[30].outputs[0].token_ids, outs[30].outputs[0].logprobs, outs[30].fingerprint) == alone, strategy
    assert windowed.stats()["verifications"] > 0


def test_riding_rows_keep_their_bits_whatever_paths_the_fast_lane_takes(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast lane's quick GEMM paths (timed at start-up; here also forced to cuBLAS at every
    small row count of every shape, where most proven paths are cuBLASLt) reach no
    deterministic row: its bits and fingerprint are those of an engine with the timed table."""
    llm = LLM(str(trained_model), gpu_memory_utilization=0.3)
    assert all(p == "cublas" for table in llm.stats()["gemm_fast"].values() for p in table.values())
    det = SamplingParams(max_tokens=48, temperature=0, logprobs=2, ignore_eos=True, deterministic=True)
    first = llm.generate(PROMPTS[0], det, use_tqdm=False)[0]
    alone = (first.outputs[0].token_ids, first.outputs[0].logprobs, first.fingerprint)
    del llm
    monkeypatch.setattr(
        gemm, "quick_tables",
        lambda layers, fast, others: {shape_of(w, b): dict.fromkeys(gemm.SMALL_ROWS, others[0]) for w, b in layers},
    )
    forced = LLM(str(trained_model), gpu_memory_utilization=0.3)
    assert forced.llm_engine.ride and forced.stats()["gemm_fast"]
    crowd = [p * (i + 1) for i, p in enumerate(PROMPTS * 6)]
    params = [SamplingParams(max_tokens=16 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(crowd))]
    outs = forced.generate([*crowd[:12], PROMPTS[0], *crowd[12:]], [*params[:12], det, *params[12:]], use_tqdm=False)
    assert (outs[12].outputs[0].token_ids, outs[12].outputs[0].logprobs, outs[12].fingerprint) == alone


def test_canonical_graph_gives_the_eager_canonical_pass_bits(trained_model: Path) -> None:
    """The replayed canonical pass (max_seq_len keys, padded sequence slots) and the eager one
    (this pass's own sizes) must agree bit for bit: both are the canonical lane."""
    llm = LLM(str(trained_model), max_num_seqs=64, determinism_strategy="whole", gpu_memory_utilization=0.3)
    engine = llm.llm_engine
    assert engine.runner.graphs is not None and engine.runner.graphs.has_canonical(engine.canonical_rows)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p * (i + 1), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    running = engine.scheduler.running
    chunks = [ScheduledChunk(r, r.num_computed_tokens - 1 - i, 1 + i) for i, r in enumerate(running)]
    tables = engine.kv.block_table(running)
    replayed = engine.runner.execute(chunks, tables, canonical=True, keep_logits=True)
    engine.runner.graphs = None
    eager = engine.runner.execute(chunks, tables, canonical=True, keep_logits=True)
    for a, b in zip(replayed, eager):
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits)
        assert [s.token_id for s in a.samples] == [s.token_id for s in b.samples]


def test_deterministic_request_has_the_same_bits_with_and_without_graphs(trained_model: Path) -> None:
    det = SamplingParams(max_tokens=48, temperature=0.8, seed=3, logprobs=2, ignore_eos=True, deterministic=True)
    outs = []
    for eager in (False, True):
        llm = LLM(str(trained_model), enforce_eager=eager)
        out = llm.generate(PROMPTS[2], det, use_tqdm=False)[0]
        outs.append((out.outputs[0].token_ids, out.outputs[0].logprobs, out.fingerprint))
        del llm
    assert outs[0] == outs[1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_engine_logprobs_match_transformers_in_bf16(trained_model: Path, deterministic: bool) -> None:
    """Graphs, fused kernels and both lanes compute the model itself, not merely the same bits twice:
    every prompt and output logprob is within bf16 noise of transformers' forward pass."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(trained_model), gpu_memory_utilization=0.3)
    params = SamplingParams(
        max_tokens=24, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True, deterministic=deterministic
    )
    out = llm.generate([PROMPTS[2], PROMPTS[4]], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(trained_model, dtype=torch.bfloat16).cuda()
    for o in out:
        ids = o.prompt_token_ids + o.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        got = [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], ids[1 : len(o.prompt_token_ids)])]
        got += [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) < 0.1, (got, want)


def test_overlapped_scheduling_gives_the_lockstep_outputs(trained_model: Path) -> None:
    """The device-side token feed through CUDA graphs, pinned copies and one-step-late results:
    the trained model's confident tokens, stop strings, logprobs and penalties come out as in lockstep."""
    from tests.test_async_scheduling import run

    lockstep, _ = run(trained_model, False, gpu_memory_utilization=0.3)
    overlapped, llm = run(trained_model, True, gpu_memory_utilization=0.3)
    assert llm.llm_engine.async_scheduling and llm.llm_engine.runner.graphs is not None
    assert overlapped == lockstep


def test_overlapped_deterministic_request_has_the_lockstep_bits_under_load(trained_model: Path) -> None:
    det = SamplingParams(max_tokens=48, temperature=0.8, seed=3, logprobs=2, ignore_eos=True, deterministic=True)
    crowd = [SamplingParams(max_tokens=20 + 7 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(12)]
    alone = LLM(str(trained_model), async_scheduling=False, gpu_memory_utilization=0.3).generate(
        PROMPTS[2], det, use_tqdm=False
    )[0]
    llm = LLM(str(trained_model), async_scheduling=True, gpu_memory_utilization=0.3)
    outs = llm.generate([*PROMPTS, PROMPTS[2], *PROMPTS * 2][:13], [*crowd[:5], det, *crowd[5:]], use_tqdm=False)
    loaded = outs[5].outputs[0]
    assert (loaded.token_ids, loaded.logprobs) == (alone.outputs[0].token_ids, alone.outputs[0].logprobs)


def test_large_canonical_passes_give_the_bits_of_small_ones_in_bf16(trained_model: Path) -> None:
    """A long prompt and whole canonical steps in passes of up to 512 rows (proven GEMMs, LM
    head on the rows that choose a token) or only in 128-row passes: the same bits.
    ``benchmarks/gemm_paths.py`` checks the GEMMs of the real model shapes."""
    long = "import numpy as np\n" * 60 + PROMPTS[0]
    det = SamplingParams(
        max_tokens=32, temperature=0.8, seed=3, logprobs=2, prompt_logprobs=1, ignore_eos=True, deterministic=True
    )
    crowd = [SamplingParams(max_tokens=20 + 7 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    seen, passes = [], []
    for largest in (128, 2048):
        llm = LLM(
            str(trained_model), max_canonical_rows=largest, determinism_strategy="whole", gpu_memory_utilization=0.3
        )
        assert llm.llm_engine.canonical.max >= min(largest, 512)  # the self-test checked them all
        out = llm.generate([long, *PROMPTS, *PROMPTS[:3]], [det, *crowd], use_tqdm=False)[0]
        seen.append((out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs, out.fingerprint))
        passes.append(llm.llm_engine.get_stats()["canonical_passes"])
        del llm
    assert seen[0] == seen[1]
    assert passes[1] < passes[0]


def test_the_scheduler_weighs_passes_the_engine_timed_at_start_up(trained_model: Path) -> None:
    """Graphed and eager passes of both lanes are timed (CPU twin: test_pass_costs.py)."""
    engine = LLM(str(trained_model), determinism_strategy="speculate", gpu_memory_utilization=0.3).llm_engine
    sched, cost = engine.scheduler.windowed, engine.scheduler.windowed.cost_model
    assert isinstance(cost, MeasuredPassCost)
    assert sched.fast_graph_rows == engine.runner.graphs.buckets[-1] and sched.graph_rows >= engine.canonical_rows
    assert cost.canonical_graphed[-1][0] == sched.graph_rows and cost.canonical_eager[-1][0] == engine.canonical.max
    for table in (cost.fast_graphed, cost.fast_eager, cost.canonical_graphed, cost.canonical_eager):
        assert table and all(ms > 0 for _, ms in table)


def test_piece_graphs_replay_the_bits_of_their_eager_twin(trained_model: Path) -> None:
    """A pass with prompt rows replays its bucket's pieces (attention eager between them) and
    gets the bits of ``PieceGraphs.forward``, the same computation run eagerly; the unpadded
    eager pass agrees within bf16 noise."""
    llm = decoding_engine(trained_model)
    engine = llm.llm_engine
    pieces = engine.runner.pieces
    assert pieces is not None and len(pieces.pieces) == len(pieces.buckets)
    running = engine.scheduler.running
    assert all(engine.kv.allocate(r, r.num_tokens) for r in running)
    chunks = [ScheduledChunk(running[0], 0, running[0].num_computed_tokens + 1)]  # its whole prompt again
    chunks += [ScheduledChunk(r, r.num_computed_tokens, 1) for r in running[1:]]
    tables = engine.kv.block_table([c.request for c in chunks])
    seen = record_logits(llm)
    replayed = engine.runner.execute(chunks, tables)
    pieces.run = pieces.forward  # type: ignore[method-assign]
    eager_pieces = engine.runner.execute(chunks, tables)
    engine.runner.pieces = None
    engine.runner.execute(chunks, tables)  # the plain eager pass: seen[2]
    assert len(seen) == 3 and seen[0].shape[0] == len(chunks) and torch.equal(seen[0], seen[1])
    assert [s.token_id for r in replayed for s in r.samples] == [s.token_id for r in eager_pieces for s in r.samples]
    rel = (seen[2] - seen[0]).norm() / seen[0].norm()
    assert rel < 2e-2, rel
