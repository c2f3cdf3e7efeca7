"""GPU-only checks of the engine: CUDA-graph decode and determinism in bf16.

CPU twins: the same engine paths run on the CPU in test_engine.py / test_determinism.py,
and every Triton kernel runs under the interpreter in test_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid import LLM, SamplingParams
from tests.test_models import record_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twins run in CI)")

PROMPTS = ["def main(", "import numpy as np\n", "class Config:\n    def __init__(self", "    for i in range(", "# test\n"]


def decoding_engine(trained_model: Path) -> LLM:
    """An engine whose requests have finished their prompts and are decoding."""
    llm = LLM(str(trained_model), max_num_seqs=64, enable_determinism=False)
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
    tables = [engine.kv.block_ids(r) for r in running]
    pos = [r.num_tokens - 1 for r in running]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    ids = [r.token_ids[-1] for r in running]
    bucket = graphs.load(ids, pos, slots, tables, [p + 1 for p in pos])
    assert bucket == 8
    replayed = graphs.replay(bucket).clone()
    eager = graphs.forward(bucket)
    assert torch.equal(replayed, eager)
    # The unpadded eager step (exact batch, its own attention schedule) agrees within bf16 noise.
    engine.runner.graphs = None
    from sid.engine.scheduler import ScheduledChunk

    seen = record_logits(llm)
    engine.runner.execute([ScheduledChunk(r, r.num_tokens - 1, 1) for r in running], tables)
    unpadded = seen[-1]
    rel = (unpadded - replayed[: len(running)]).norm() / replayed[: len(running)].norm()
    assert rel < 2e-2, rel


def test_deterministic_request_is_identical_alone_and_under_load_in_bf16(trained_model: Path) -> None:
    llm = LLM(str(trained_model))
    det = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, deterministic=True)
    alone = llm.generate(PROMPTS[0], det, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [p * (i + 1) for i, p in enumerate(PROMPTS * 12)]
    params = [SamplingParams(max_tokens=32 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(crowd))]
    for strategy in ("auto", "speculate", "direct", "whole"):
        llm.llm_engine.scheduler.strategy = strategy
        outs = llm.generate([*crowd[:30], PROMPTS[0], *crowd[30:]], [*params[:30], det, *params[30:]], use_tqdm=False)
        assert outs[30].outputs[0].token_ids == alone, strategy
    assert llm.stats()["verifications"] > 0
