"""Sampling: row-pure randomness, the right distribution, truncation and penalties."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid import LLM, SamplingParams
from sid.runtime import sampler
from sid.runtime.sampler import SamplingBatch, apply_penalties, compute_logprobs, gumbel_noise, sample

V = 64


def batch(rows: int, **overrides: object) -> SamplingBatch:
    fields: dict[str, object] = dict(
        temperature=torch.ones(rows),
        top_k=torch.full((rows,), V),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.full((rows,), 1234),
        positions=torch.arange(rows),
        any_random=True,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)  # type: ignore[arg-type]


def test_noise_is_a_function_of_seed_position_and_token_only() -> None:
    seeds = torch.tensor([7, 7, 8, 7])
    positions = torch.tensor([3, 4, 3, 3])
    noise = gumbel_noise(seeds, positions, V)
    assert torch.equal(noise[0], noise[3])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    alone = gumbel_noise(seeds[1:2], positions[1:2], V)
    assert torch.equal(alone[0], noise[1])
    # Standard Gumbel: mean is the Euler-Mascheroni constant, variance pi^2 / 6.
    big = gumbel_noise(torch.arange(200), torch.zeros(200, dtype=torch.int64), 1000)
    assert abs(big.mean().item() - 0.5772) < 0.02
    assert abs(big.var().item() - 1.6449) < 0.05


def test_sampled_token_does_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, V)
    full = sample(logits, batch(9, seeds=torch.arange(9) + 100, positions=torch.arange(9) * 5)).token_ids
    for i in range(9):
        one = sample(
            logits[i : i + 1], batch(1, seeds=torch.tensor([100 + i]), positions=torch.tensor([5 * i]))
        ).token_ids
        assert one.item() == full[i].item()


def test_rows_taken_a_block_at_a_time_keep_their_tokens_and_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big pass's rows go through the sampler in blocks (``BLOCK_LOGITS``): every result the
    same as in one block, penalties' per-row tensors sliced with their rows."""
    torch.manual_seed(1)
    rows = 11
    logits = torch.randn(rows, V) * 3
    settings = batch(
        rows, seeds=torch.arange(rows) + 7, temperature=torch.rand(rows) + (torch.arange(rows) % 3 == 0) * -9,
        top_k=torch.randint(1, V, (rows,)), top_p=torch.rand(rows), min_p=torch.rand(rows) * 0.1,
        frequency_penalty=torch.rand(rows), presence_penalty=torch.rand(rows),
        output_counts=torch.randint(0, 3, (rows, V)), num_logprobs=3, any_top_k=True, any_top_p_or_min_p=True,
    )
    settings.temperature.clamp_(min=0)
    whole = sample(logits, settings)
    targets = torch.randint(0, V, (rows,))
    scored = compute_logprobs(logits, targets, 2)
    monkeypatch.setattr(sampler, "BLOCK_LOGITS", 3 * V)  # blocks of 3, 3, 3 and 2 rows
    blocked = sample(logits, settings)
    assert whole.token_ids.unique().numel() > 1
    for name in ("token_ids", "logprob", "rank", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(blocked, name), getattr(whole, name)), name
    again = compute_logprobs(logits, targets, 2)
    for name in ("logprob", "rank", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(again, name), getattr(scored, name)), name


def test_samples_follow_softmax_with_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0] + [-30.0] * (V - 4))
    n = 20000
    rows = logits.expand(n, V).contiguous()
    b = batch(n, temperature=torch.full((n,), 0.7))
    counts = torch.bincount(sample(rows, b).token_ids, minlength=V).float() / n
    expected = (logits / 0.7).softmax(-1)
    assert (counts - expected).abs().max().item() < 0.015


def test_top_k_top_p_min_p_truncate_the_distribution() -> None:
    logits = torch.linspace(3.0, -3.0, V)  # token 0 is the most likely
    probs = logits.softmax(-1)
    n = 4000
    rows = logits.expand(n, V).contiguous()
    drawn = sample(rows, batch(n, top_k=torch.full((n,), 3), any_top_k=True)).token_ids
    assert set(drawn.tolist()) == {0, 1, 2}
    nucleus = int((probs.cumsum(-1) < 0.5).sum()) + 1
    drawn = sample(rows, batch(n, top_p=torch.full((n,), 0.5), any_top_p_or_min_p=True)).token_ids
    assert set(drawn.tolist()) == set(range(nucleus))
    kept = int((probs >= 0.3 * probs[0]).sum())
    drawn = sample(rows, batch(n, min_p=torch.full((n,), 0.3), any_top_p_or_min_p=True)).token_ids
    assert set(drawn.tolist()) == set(range(kept))


def test_greedy_rows_take_the_argmax_beside_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    out = sample(logits, batch(6, temperature=temps)).token_ids
    for i in (0, 2, 4):
        assert out[i].item() == logits[i].argmax().item()


def test_penalties_match_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2, 0, 1, 0]])
    seen = torch.tensor([[True, True, True, False]])
    b = batch(
        1,
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]),
        output_counts=counts,
        seen=seen,
    )
    out = apply_penalties(logits, b)
    expected = torch.tensor([[2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0]])
    assert torch.allclose(out, expected)


def test_seeded_request_is_identical_alone_and_in_a_crowd(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=256)
    target = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate("def main(", target, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["import os\n", "class A:\n", "def main(", "x = [", "# test\n"]
    params = [SamplingParams(max_tokens=20 + i, temperature=1.0, ignore_eos=True) for i in range(5)]
    params[2] = target
    outs = llm.generate(crowd, params, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    other_seed = llm.generate(
        "def main(", SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=43, ignore_eos=True),
        use_tqdm=False
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_penalised_generation_avoids_repeats(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64)
    plain = llm.generate("def main(", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    penalised = llm.generate(
        "def main(", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=2.0),
        use_tqdm=False
    )[0]
    def distinct(ids: list[int]) -> int:
        return len(set(ids))
    assert distinct(penalised.outputs[0].token_ids) > distinct(plain.outputs[0].token_ids)
