"""Overlapped scheduling: step N+1 is planned and launched before step N's tokens are read.

On the CPU nothing actually overlaps (kernels run on the host), but every piece of the
bookkeeping does run: placeholders, the device-side token feed, one-step-late results,
epochs that void in-flight work after a rollback or a preemption, and the drain before a
step that needs real tokens on the host. The GPU twin (tests/test_gpu.py) runs the same
engine where the copies are truly asynchronous.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid import LLM, SamplingParams
from sid.runtime.faults import FAULTS
from sid.runtime.model_runner import TokenFeed, placeholder

PROMPT = "def fibonacci(n):\n"
PROMPTS = ["def main(", "import os\nimport sys\n", "class Node:\n", "    for i in range(", "# utils\ndef "] * 3


def mixed_params() -> list[SamplingParams]:
    """Every per-request feature at once: lengths, stops, logprobs, penalties, seeded sampling."""
    out = []
    for i in range(len(PROMPTS)):
        out.append(
            SamplingParams(
                max_tokens=12 + 3 * i,
                temperature=0.8 if i % 5 == 2 else 0.0,
                seed=i,
                logprobs=2 if i % 3 == 0 else None,
                prompt_logprobs=1 if i == 5 else None,
                stop=["\n\n"] if i % 4 == 1 else None,
                presence_penalty=0.5 if i == 7 else 0.0,
            )
        )
    return out


def run(trained_model: Path, overlap: bool, **kw: object) -> tuple[list[tuple], LLM]:
    llm = LLM(str(trained_model), async_scheduling=overlap, **kw)
    outs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], llm


@pytest.mark.parametrize(
    "kv", [dict(num_kv_blocks=512), dict(num_kv_blocks=24, block_size=8)], ids=["roomy", "preempting"]
)
def test_overlap_gives_the_same_outputs_as_stepping_in_lockstep(trained_model: Path, kv: dict) -> None:
    """The trained model's confident greedy choices survive the fast lane's batch noise, so
    lockstep and overlapped runs must agree token for token, also when requests are preempted
    while a step that includes them is in flight."""
    lockstep, _ = run(trained_model, False, **kv)
    overlapped, llm = run(trained_model, True, **kv)
    assert overlapped == lockstep
    engine = llm.llm_engine
    if kv["num_kv_blocks"] == 24:
        assert engine.scheduler.stats.preemptions > 0
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_results_arrive_one_step_late_and_abort_frees_everything(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", "def main(", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.add_request("b", "import os\n", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert engine.step() == []  # the prompts are in flight
    lengths: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(5):
        for out in engine.step():
            lengths[out.request_id].append(len(out.outputs[0].token_ids))
    assert lengths["a"] == [1, 2, 3, 4] and lengths["b"] == [1, 2, 3, 4, 5]
    b = engine.requests["b"]
    assert b.token_ids[-1] < 0  # the token of the step in flight is still a placeholder
    engine.abort_request("b")
    assert engine.has_unfinished_requests()  # the launched step must still be read
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


@pytest.mark.parametrize("strategy", ["speculate", "direct", "whole"])
def test_overlap_keeps_deterministic_bits_through_rollbacks(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Under fast-lane faults, rollbacks void steps already launched on the proposals;
    the deterministic outputs must still equal the unperturbed lockstep run's."""
    det = [
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, deterministic=True),
        SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, deterministic=True),
    ]
    crowd = [SamplingParams(max_tokens=10 + 3 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    reference = LLM(str(trained_model), num_kv_blocks=256, async_scheduling=False).generate(
        [PROMPT] * 2, det, use_tqdm=False
    )
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
    llm = LLM(str(trained_model), num_kv_blocks=12, block_size=8, determinism_strategy=strategy, async_scheduling=True)
    outs = llm.generate([PROMPT, PROMPT, *PROMPTS[:4]], [*det, *crowd], use_tqdm=False)
    for ref, out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = llm.llm_engine.get_stats()
    assert stats["preemptions"] > 0
    if strategy == "speculate":
        assert stats["rollbacks"] > 0


def test_token_feed_resolves_placeholders_of_its_own_step_only() -> None:
    tokens = torch.tensor([11, 22, 33])
    feed = TokenFeed(tokens, step=7)
    ids = [5, placeholder(7, 2), 6, placeholder(7, 0)]
    assert TokenFeed.check(ids, feed) is feed
    assert TokenFeed.check([5, 6], feed) is None
    device_ids = torch.tensor(ids)
    feed.resolve(device_ids)
    assert device_ids.tolist() == [5, 33, 6, 11]
    with pytest.raises(RuntimeError, match="no finished or in-flight step"):
        TokenFeed.check([placeholder(6, 0)], feed)  # an older step's token was never filled in
    with pytest.raises(RuntimeError, match="no finished or in-flight step"):
        TokenFeed.check([placeholder(7, 3)], feed)  # past the step's sampled tokens
    with pytest.raises(RuntimeError, match="no finished or in-flight step"):
        TokenFeed.check([placeholder(7, 0)], None)


def test_no_work_is_planned_past_a_last_token_in_flight(trained_model: Path) -> None:
    """Requests whose final token is being sampled get no further rows, so they neither take
    cache blocks nor push others out: two one-block prompts fill a three-block cache."""
    stats = []
    for overlap in (False, True):
        llm = LLM(str(trained_model), block_size=8, num_kv_blocks=3, async_scheduling=overlap)
        prompts = [{"prompt_token_ids": [10 + i] * 8} for i in range(2)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        stats.append(llm.stats())
    assert stats[1]["preemptions"] == 0
    assert stats[1]["scheduled_tokens"] == stats[0]["scheduled_tokens"] == 16


def test_stats_and_stop_tokens_under_overlap(trained_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every proposal is accounted for once (accepted, or recomputed after a rollback), in
    both modes; a proposed stop token is verified as soon as it is seen, not a window later."""
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
    det = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, deterministic=True)
    crowd = [SamplingParams(max_tokens=10 + 3 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    for overlap in (False, True):
        llm = LLM(str(trained_model), num_kv_blocks=256, determinism_strategy="speculate", async_scheduling=overlap)
        llm.generate([PROMPT, PROMPT, *PROMPTS[:4]], [det, det, *crowd], use_tqdm=False)
        s = llm.stats()
        assert s["rollbacks"] > 0
        assert s["proposed_tokens"] == s["accepted_tokens"] + s["recomputed_tokens"], (overlap, s)
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 0.0)
    tokens = LLM(str(trained_model), num_kv_blocks=64).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0),
                                                                use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=40, temperature=0, deterministic=True, stop_token_ids=[tokens[3]])
    proposed = []
    for overlap in (False, True):
        llm = LLM(str(trained_model), num_kv_blocks=64, determinism_strategy="speculate", async_scheduling=overlap)
        out = llm.generate(PROMPT, stop, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[: tokens.index(tokens[3]) + 1] and out.finish_reason == "stop"
        proposed.append(llm.stats()["proposed_tokens"])
    assert proposed[1] <= proposed[0] + 1  # at most the proposal in flight when the stop token lands
