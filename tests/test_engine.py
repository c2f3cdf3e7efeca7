"""Continuous batching, prefix caching, preemption and the step-level engine API."""

from __future__ import annotations

from pathlib import Path

import torch

from sid import LLM, SamplingParams
from tests.test_models import record_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_prefix_cache_reuses_blocks_and_matches_a_cold_run(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["llama"])
    prefix = list(range(10, 10 + 80))
    a, b = prefix + [5, 6, 7], prefix + [8, 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)

    cold = LLM(path, num_kv_blocks=64, enable_prefix_caching=False)
    cold_out = cold.generate({"prompt_token_ids": b}, params, use_tqdm=False)[0]

    warm = LLM(path, num_kv_blocks=64)
    seen = record_logits(warm)
    warm.generate({"prompt_token_ids": a}, params, use_tqdm=False)
    kv = warm.llm_engine.kv
    hits_before = kv.stats.hits
    seen.clear()
    warm_out = warm.generate({"prompt_token_ids": b}, params, use_tqdm=False)[0]
    assert warm_out.num_cached_tokens == 80  # five full 16-token blocks of the shared prefix
    assert kv.stats.hits - hits_before == 80
    assert cold_out.num_cached_tokens == 0
    assert warm_out.outputs[0].token_ids == cold_out.outputs[0].token_ids
    cold_lps = [e[t].logprob for t, e in zip(cold_out.outputs[0].token_ids, cold_out.outputs[0].logprobs)]
    warm_lps = [e[t].logprob for t, e in zip(warm_out.outputs[0].token_ids, warm_out.outputs[0].logprobs)]
    assert torch.allclose(torch.tensor(warm_lps), torch.tensor(cold_lps), atol=1e-5)
    # The first step of the warm run computed only the 2 uncached prompt tokens' last row.
    assert seen[0].shape[0] == 1
    # Everything finished: all blocks are free again (cached ones stay reusable).
    assert kv.pool.num_free == kv.pool.num_blocks and kv.pool.num_cached() > 0
    # Until the cache is reset, which is refused while a request is unfinished.
    warm.llm_engine.add_request("pending", {"prompt_token_ids": b}, params)
    assert not warm.reset_prefix_cache() and kv.pool.num_cached() > 0
    warm.llm_engine.abort_request("pending")
    assert warm.reset_prefix_cache() and kv.pool.num_cached() == 0
    again = warm.generate({"prompt_token_ids": b}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cold_out.outputs[0].token_ids


def test_blocks_are_freed_and_reused_across_many_requests(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["qwen2"]), num_kv_blocks=24, max_num_seqs=4)
    prompts = [{"prompt_token_ids": list(range(i, i + 40))} for i in range(12)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    pool = llm.llm_engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert pool.evictions > 0  # 12 requests x 4 blocks cannot all stay cached in 24 blocks


def test_preemption_finishes_every_request_with_the_same_tokens(trained_model: Path) -> None:
    prompts = ["def main(", "import os\nimport sys\n", "class Node:\n", "    for i in range(", "# utils\ndef "]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    roomy = LLM(str(trained_model), num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    tight = LLM(str(trained_model), num_kv_blocks=14, block_size=8)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.stats.preemptions > 0
    for ref, out in zip(roomy, outs):
        assert len(out.outputs[0].token_ids) == 60
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_step_api_is_cumulative_and_abort_frees_blocks(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", "def main(", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.add_request("b", "import os\n", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    lengths: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for out in engine.step():
            lengths[out.request_id].append(len(out.outputs[0].token_ids))
    assert lengths["a"] == [1, 2, 3, 4, 5]
    assert lengths["b"] == [1, 2, 3, 4, 5, 6]
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 1
    # A request joining mid-run is batched with the running one.
    engine.add_request("c", "class A:\n", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = engine.step()
    assert {o.request_id for o in outs} == {"b", "c"}
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_stop_conditions(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64)
    base = llm.generate("def main(", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[10:14]
    out = llm.generate("def main(", SamplingParams(max_tokens=40, temperature=0, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]
    out = llm.generate(
        "def main(", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[7]]), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == ids[: ids.index(ids[7]) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[7]
    out = llm.generate("def main(", SamplingParams(max_tokens=7, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == ids[:7]


def test_eos_stops_and_max_model_len_caps(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64, max_model_len=20)
    out = llm.generate("def main(", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"
    # Make a token the greedy run produces count as end-of-sequence for this engine.
    llm = LLM(str(trained_model), num_kv_blocks=64)
    ids = llm.generate(
        "def main(", SamplingParams(max_tokens=20, temperature=0), use_tqdm=False
    )[0].outputs[0].token_ids
    llm.llm_engine.inputs.eos_token_ids = frozenset({ids[5]})
    out = llm.generate("def main(", SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[5]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate("def main(", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids


def test_input_forms_and_order(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64)
    tok = llm.get_tokenizer()
    ids = tok("def main(").input_ids
    params = SamplingParams(max_tokens=6, temperature=0)
    forms = ["def main(", {"prompt": "def main("}, {"prompt_token_ids": ids}, ids]
    outs = [llm.generate(f, params, use_tqdm=False)[0] for f in forms]
    assert all(o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    assert outs[0].prompt == "def main(" and outs[2].prompt is None and outs[3].prompt_token_ids == ids
    batch = llm.generate([ids, [1, 2, 3], "x = "], [params, params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert [o.prompt_token_ids for o in batch] == [ids, [1, 2, 3], tok("x = ").input_ids]
    assert len(batch[2].outputs[0].token_ids) == 2
