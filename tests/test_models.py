"""Sid's logits, logprobs and greedy tokens agree with Hugging Face transformers (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sid import LLM, SamplingParams

PROMPTS = [
    "def partial(func, *args, **keywords):\n    \"\"\"New function with partial application",
    "class JSONDecoder(object):\n    def __init__(self, *, object_hook=None, parse_float=None,",
    "import string\nfrom functools import reduce\n\nvalues = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]",
]


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """Wrap the model's LM head so every logits tensor the engine computes is kept."""
    model = llm.llm_engine.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def wrapped(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = wrapped  # type: ignore[method-assign]
    return seen


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    bound = 1e-4 * ref.abs().max().item()
    assert err <= bound, f"max |delta| {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_teacher_forced_logits_match_transformers(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    # A small token budget splits each prompt into chunks that attend to their cached prefix.
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=11)
    seen = record_logits(llm)
    tok = llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        assert len(ids) >= 25
        seen.clear()
        out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
        ours = torch.cat(seen)
        ref = hf_logits(path, ids)
        assert ours.shape == ref.shape
        assert_close(ours, ref)
        ref_lp = ref.log_softmax(-1)
        lps = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
        expected = [ref_lp[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
        assert out.prompt_logprobs[0] is None
        assert torch.allclose(torch.tensor(lps), torch.tensor(expected), atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generated_logprobs_match_transformers(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    llm = LLM(str(path), num_kv_blocks=64)
    prompt = PROMPTS[0]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 24 and len(comp.logprobs) == 24
    full = out.prompt_token_ids + comp.token_ids
    ref_lp = hf_logits(path, full).log_softmax(-1)
    n = len(out.prompt_token_ids)
    for i, (tok_id, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref_lp[n - 1 + i]
        assert abs(entry[tok_id].logprob - row[tok_id].item()) <= 1e-4 * 20
        assert len(entry) <= 4
        top = row.topk(3)
        ours_top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
        # Random weights give near-ties: compare the top set's logprobs, not its order.
        for rank, t in ours_top:
            assert abs(entry[t].logprob - row[t].item()) <= 2e-3
        assert abs(max(lp.logprob for lp in entry.values()) - top.values[0].item()) <= 2e-3
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))


def test_trained_model_greedy_tokens_match_transformers_generate(trained_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(trained_model))
    hf = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32)
    prompts = ["def main(", "import numpy as np\n", "class Config:\n    def __init__(self", "    for i in range("]
    llm = LLM(str(trained_model), num_kv_blocks=128, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
        assert out.outputs[0].text == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
