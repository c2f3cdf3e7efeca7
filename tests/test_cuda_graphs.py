"""The CUDA graphs' static inputs, checked on the CPU (the GPU twin replays real graphs in
tests/test_gpu.py).

A graph replays what ``CUDAGraphs.forward`` computed at capture, reading the static
buffers. Here ``forward`` stands in for the replay, so the runner's graph path (padding to a
bucket or to the canonical shape, empty sequence slots, placeholder layouts) runs on the
CPU with the torch attention backend and is compared with the eager runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid import LLM, SamplingParams
from sid.engine.engine import LLMEngine
from sid.engine.kv_cache import cdiv
from sid.engine.plan import ScheduledChunk
from sid.runtime.cuda_graphs import CUDAGraphs
from sid.runtime.model_runner import ChunkResult
from sid.runtime.piecewise_graphs import PieceGraphs, piece_buckets
from tests.test_models import record_logits

PROMPTS = ["def main(", "import numpy as np\n", "class Config:\n    def __init__(self", "    for i in range(", "# t\n"]


@pytest.fixture
def engine(trained_model: Path, windowed_lane: None) -> LLMEngine:
    """Five requests past their prompts, with graphs built (not captured) beside the runner; no
    GEMM path is proven, so deterministic requests take the canonical lane and its graphs."""
    llm = LLM(str(trained_model), max_num_seqs=8, dtype="float32")
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p * (i + 1), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    return engine


def graphs_for(engine: LLMEngine, riding: bool = False, invariant_decode: bool = False) -> CUDAGraphs:
    max_positions = max(engine.max_model_len, engine.canonical.max)
    graphs = CUDAGraphs(
        engine.model,
        engine.kv_cache,
        max_batch=8,
        canonical_sizes=engine.canonical.sizes[:2],
        max_blocks=cdiv(max_positions, engine.config.block_size),
        max_seq_len=max_positions,
        riding=riding,
        invariant_decode=invariant_decode,
        canonical_invariant=engine.model.gemms.invariant is not None,
    )
    return graphs  # never captured on the CPU: ``replay`` computes what the graph would


def run(
    engine: LLMEngine, chunks: list[ScheduledChunk], graphs: CUDAGraphs | None, canonical: bool
) -> list[ChunkResult]:
    engine.runner.graphs = graphs
    tables = engine.kv.block_table([c.request for c in chunks])
    return engine.runner.execute(chunks, tables, canonical=canonical, keep_logits=True)


def test_every_placeholder_is_a_valid_pass_that_writes_nothing(engine: LLMEngine) -> None:
    graphs = graphs_for(engine)
    cache = [t.clone() for t in engine.kv_cache.k + engine.kv_cache.v]
    cos = engine.model.rotary.cos.clone()
    for shape in graphs.shapes:
        graphs.load_placeholder(shape)
        qsl = graphs.query_start_loc[: shape.seqs + 1]
        q_lens = qsl[1:] - qsl[:-1]
        assert int(qsl[0]) == 0 and int(qsl[-1]) == shape.rows, shape
        assert bool((q_lens >= 0).all()) and bool((q_lens <= graphs.seq_lens[: shape.seqs]).all()), shape
        with torch.inference_mode():
            logits = graphs.forward(shape)
        assert logits.shape[0] == shape.rows and bool(torch.isfinite(logits).all()), shape
    assert all(torch.equal(a, b) for a, b in zip(cache, engine.kv_cache.k + engine.kv_cache.v))
    assert torch.equal(cos, engine.model.rotary.cos)
    assert graphs.has_canonical(engine.canonical_rows) and graphs.has_canonical(2 * engine.canonical_rows)


def test_a_canonical_pass_through_the_static_buffers_has_the_eager_bits(engine: LLMEngine) -> None:
    """Ragged chunks, an empty-slot tail and the padding sequence: the same bits as eager."""
    running = engine.scheduler.running
    chunks = [ScheduledChunk(r, r.num_computed_tokens - 1 - i, 1 + i) for i, r in enumerate(running)]
    eager = run(engine, chunks, None, canonical=True)
    graphed = run(engine, chunks, graphs_for(engine), canonical=True)
    for a, b in zip(eager, graphed):
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits)
        assert [s.token_id for s in a.samples] == [s.token_id for s in b.samples]


def test_a_larger_canonical_graph_gives_the_rows_of_the_eager_pass_and_its_smaller_head(engine: LLMEngine) -> None:
    """A pass of 2 x M_canon rows: the graph computes every row's logits, the eager pass only
    those of rows that choose a token, in an LM head of M_canon rows: the same bits for those."""
    m = engine.canonical_rows
    running = engine.scheduler.running
    chunks = [ScheduledChunk(r, 0, r.num_computed_tokens) for r in running[:3]]  # whole prompts, recomputed
    assert m < sum(c.num_tokens for c in chunks) <= 2 * m
    eager = run(engine, chunks, None, canonical=True)
    graphed = run(engine, chunks, graphs_for(engine), canonical=True)
    for a, b in zip(eager, graphed):
        assert a.logits is not None and b.logits is not None
        chosen = {s.position: (s.token_id, a.logits[k]) for k, s in enumerate(a.samples)}
        every = {s.position: (s.token_id, b.logits[k]) for k, s in enumerate(b.samples)}
        assert len(chosen) < len(every)  # the eager pass left out the prompt's inner rows
        assert chosen.keys() == {p for p in every if p >= a.samples[0].position}
        for p, (token, logits) in chosen.items():
            assert token == every[p][0] and torch.equal(logits, every[p][1])


def test_a_decode_step_padded_to_its_bucket_matches_the_eager_step(engine: LLMEngine) -> None:
    """Five rows padded to the bucket of 8: float32 on the CPU varies with the row count, so
    the logits agree to rounding and the greedy tokens exactly."""
    running = engine.scheduler.running
    assert all(r.num_computed_tokens == r.num_tokens - 1 and engine.kv.allocate(r, r.num_tokens) for r in running)
    chunks = [ScheduledChunk(r, r.num_computed_tokens, 1) for r in running]  # each samples the next token
    graphs = graphs_for(engine)
    assert graphs.bucket(len(chunks)) == 8
    seen: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(original(hidden).clone())
        return seen[-1]

    engine.model.compute_logits = recorded  # type: ignore[method-assign]
    eager = run(engine, chunks, None, canonical=False)
    graphed = run(engine, chunks, graphs, canonical=False)
    tokens = [s.token_id for r in eager for s in r.samples]
    assert len(tokens) == len(chunks) and tokens == [s.token_id for r in graphed for s in r.samples]
    assert [t.shape[0] for t in seen] == [len(chunks), 8]
    scale = float(seen[0].abs().max())
    torch.testing.assert_close(seen[1][: len(chunks)], seen[0], rtol=0, atol=1e-4 * scale)


def test_a_decode_step_where_not_every_row_samples_keeps_the_right_rows(engine: LLMEngine) -> None:
    """Row 0 recomputes a position without sampling: the graph's logits are gathered, not sliced."""
    running = engine.scheduler.running
    assert all(engine.kv.allocate(r, r.num_tokens) for r in running)
    chunks = [ScheduledChunk(running[0], running[0].num_computed_tokens - 1, 1)]
    chunks += [ScheduledChunk(r, r.num_computed_tokens, 1) for r in running[1:]]
    eager = run(engine, chunks, None, canonical=False)
    graphed = run(engine, chunks, graphs_for(engine), canonical=False)
    assert not eager[0].samples and not graphed[0].samples
    tokens = [[s.token_id for s in r.samples] for r in eager]
    assert all(len(t) == 1 for t in tokens[1:]) and tokens == [[s.token_id for s in r.samples] for r in graphed]


def test_a_riding_decode_step_through_the_graph_buffers_has_the_eager_bits(trained_model: Path) -> None:
    """Deterministic rows riding in a decode step padded to its bucket: the graph's per-sequence
    attention flags and row-invariant GEMMs give them the eager ride pass's bits, while the
    normal rows beside them keep the fast schedule."""
    llm = LLM(str(trained_model), max_num_seqs=8, dtype="bfloat16")
    engine = llm.llm_engine
    assert engine.ride
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, deterministic=i % 2 == 0)
        engine.add_request(f"r{i}", p * (i + 1), params)
    for _ in range(4):
        engine.step()
    running = engine.scheduler.running
    assert all(engine.kv.allocate(r, r.num_tokens) for r in running)
    chunks = [ScheduledChunk(r, r.num_computed_tokens, 1) for r in running]
    engine.runner.ride = True
    eager = run(engine, chunks, None, canonical=False)
    graphs = graphs_for(engine, riding=True, invariant_decode=True)
    graphed = run(engine, chunks, graphs, canonical=False)
    assert graphs.canonical_seqs[: len(chunks)].tolist() == [int(c.request.deterministic) for c in chunks]
    for chunk, a, b in zip(chunks, eager, graphed):
        if chunk.request.deterministic:
            assert [s.token_id for s in a.samples] == [s.token_id for s in b.samples]


@pytest.mark.parametrize("ride", [False, True], ids=["fast", "ride"])
def test_a_pass_with_prompt_rows_through_the_piece_buffers_has_the_eager_bits(trained_model: Path, ride: bool) -> None:
    """Prompt chunks (one recomputed whole, one with a cached prefix) beside decode rows, padded
    to a piece bucket: ``PieceGraphs.forward`` (what the pieces replay, attention between
    them) gives every logit row the eager pass's bits. In bfloat16 this CPU's GEMMs keep a
    row's bits at every row count; riding, both take the proven paths and the padded pass's
    deterministic rows attend canonically. Nothing is written for the padding rows."""
    llm = LLM(str(trained_model), max_num_seqs=8, dtype="bfloat16")
    engine = llm.llm_engine
    assert engine.ride
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, deterministic=ride and i % 2 == 0)
        engine.add_request(f"r{i}", p * (i + 1), params)
    for _ in range(3):
        engine.step()
    running = engine.scheduler.running
    assert all(engine.kv.allocate(r, r.num_tokens) for r in running)
    chunks = [ScheduledChunk(running[0], 0, running[0].num_computed_tokens + 1)]
    chunks.append(ScheduledChunk(running[1], 2, running[1].num_computed_tokens - 1))
    chunks += [ScheduledChunk(r, r.num_computed_tokens, 1) for r in running[2:]]
    rows = sum(c.num_tokens for c in chunks)
    engine.runner.ride = ride
    seen = record_logits(llm)
    eager = run(engine, chunks, None, canonical=False)
    buckets = piece_buckets(engine.config.max_num_batched_tokens, engine.canonical.sizes if ride else None)
    pieces = PieceGraphs(engine.model, engine.kv_cache, buckets, invariant=ride)
    replays: list[tuple[int, int]] = []

    def replay(rows: int, bucket: int) -> torch.Tensor:  # what a replay computes
        replays.append((rows, bucket))
        return pieces.forward(rows, bucket)

    pieces.run = replay  # type: ignore[method-assign]
    cache = [t.clone() for t in engine.kv_cache.k + engine.kv_cache.v]
    engine.runner.pieces = pieces
    graphed = run(engine, chunks, None, canonical=False)
    assert all(torch.equal(a, b) for a, b in zip(cache, engine.kv_cache.k + engine.kv_cache.v))
    assert len(replays) == 1 and replays[0][0] >= rows and replays[0][1] == pieces.bucket(replays[0][0]) > rows
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    for a, b in zip(eager, graphed):
        assert [(s.position, s.token_id) for s in a.samples] == [(s.position, s.token_id) for s in b.samples]
