"""Deterministic rows that ride in ordinary passes (DESIGN 1b).

Where every GEMM is proven to give a row the same bits at every row count, a deterministic
request's rows share passes with normal rows: the pass takes the proven GEMM paths and is
padded to a proven size, and only those rows attend with the canonical schedule. Every
token is committed as soon as it is sampled: no canonical pass, no verification.

On this CPU, bfloat16 GEMMs keep a row's bits at every row count for most of the trained
model's shapes and the tiled path covers the rest (``sid.runtime.gemm``). The faults make
the fast lane's numerics depend on the batch in its logits, its attention and its GEMMs,
strongly enough to flip tokens, so these tests fail if a riding row took anything from them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sid import LLM, SamplingParams
from sid.engine import engine as engine_module
from sid.engine import selftest
from sid.engine.plan import PassSizes, ScheduledChunk
from sid.engine.selftest import DeterminismSelfTestError, synthetic_request
from sid.model.builtin import write_checkpoint
from sid.repro import Repro, summarize
from sid.runtime import gemm
from sid.runtime.attention import TorchAttentionBackend
from sid.runtime.faults import FAULTS, batch_noise
from sid.runtime.gemm import GemmPath, Gemms, candidates, prove, prove_columns, prove_plan, run
from tests.test_determinism import CROWD, PROMPT, crowd_params, det, fresh_process_output

BF16 = dict(dtype="bfloat16")


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast lane's logits, attention and GEMMs get batch-dependent noise."""
    monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
    monkeypatch.setattr(FAULTS, "fast_attention_noise", 0.5)
    monkeypatch.setattr(FAULTS, "fast_gemm_noise", 0.05)


@pytest.fixture(scope="module")
def reference(trained_model: Path) -> dict:
    """Deterministic outputs computed alone, one request at a time, with no faults."""
    llm = LLM(str(trained_model), num_kv_blocks=512, **BF16)
    params = {"greedy": det(), "seeded": det(temperature=0.9, top_p=0.95, seed=5), "logprobs": det(logprobs=3)}
    outs = {key: llm.generate(PROMPT, p, use_tqdm=False)[0] for key, p in params.items()}
    return {"greedy": outs["greedy"].outputs[0].token_ids, "seeded": outs["seeded"].outputs[0].token_ids,
            "logprobs": outs["logprobs"], "fingerprint": llm.llm_engine.fingerprint}


def test_rows_ride_where_the_gemms_are_proven(trained_model: Path, reference: dict) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=256, **BF16)
    engine = llm.llm_engine
    stats = engine.get_stats()
    assert stats["determinism"] == "ride" and engine.canonical_rows == 1
    assert set(stats["gemm_paths"]) == {"640x384", "384x384", "2048x384", "384x1024", "8192x384"}
    assert engine.numerics["gemms"] == stats["gemm_paths"] and engine.numerics["canonical_rows"] is None
    outs = llm.generate([PROMPT, *CROWD], [det(), *crowd_params(len(CROWD))], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference["greedy"]
    stats = engine.get_stats()
    assert stats["strategy_choices"]["ride"] > 0 and stats["canonical_passes"] == 0
    assert stats["verifications"] == stats["rollbacks"] == stats["proposed_tokens"] == 0


def test_six_compositions_three_trials_under_fast_lane_faults(trained_model: Path, faults: None) -> None:
    llm = LLM(str(trained_model), **BF16)
    runs = Repro(llm.llm_engine, max_tokens=16, trials=3, long_prompt=256, prompt=PROMPT).run()
    summary = summarize(runs)
    assert summary["deterministic"]["runs"] == 18 and summary["deterministic"]["distinct_outputs"] == 1
    assert all(r.first_divergence is None for r in runs if r.mode == "deterministic")
    assert summary["normal"]["distinct_outputs"] > 1  # the faults really change what the fast lane computes
    assert llm.llm_engine.get_stats()["rollbacks"] == 0


def test_greedy_seeded_and_logprobs_beside_normal_rows_equal_the_alone_run(
    trained_model: Path, reference: dict, faults: None
) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=512, **BF16)
    params = [det(), det(temperature=0.9, top_p=0.95, seed=5), det(logprobs=3)]
    outs = llm.generate(
        [*CROWD[:2], PROMPT, PROMPT, PROMPT, *CROWD[2:]], [*crowd_params(2), *params, *crowd_params(3)], use_tqdm=False
    )
    assert outs[2].outputs[0].token_ids == reference["greedy"]
    assert outs[3].outputs[0].token_ids == reference["seeded"]
    ref = reference["logprobs"].outputs[0]
    assert outs[4].outputs[0].token_ids == ref.token_ids
    assert outs[4].outputs[0].logprobs == ref.logprobs  # bit-identical floats, ranks and top-3 sets
    assert all(o.fingerprint == reference["fingerprint"] for o in outs[2:5])
    normal = llm.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert normal.outputs[0].token_ids != reference["greedy"]  # the faults do reach normal requests


def test_a_riding_request_beside_long_prompts_keeps_the_alone_bits(
    trained_model: Path, reference: dict, faults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The down projection is proven only in GEMMs of at most 32 rows (``cpu:max32``), so in
    passes with long prompts only the deterministic rows take that path and the prompts' rows
    the fast one (``RowSplit``): the deterministic request's tokens and logprobs stay those of
    its alone run, where every pass ran all its rows on the proven paths (the reference's, on
    the paths this machine proves)."""
    splits: list[tuple[int, int]] = []  # (canonical rows, rows) of each pass that split them
    split_of = Gemms.split_of

    def spy(self: Gemms, flags: np.ndarray, device: torch.device) -> gemm.RowSplit | None:
        split = split_of(self, flags, device)
        if split is not None:
            splits.append((split.count, len(flags)))
        return split

    monkeypatch.setattr(Gemms, "split_of", spy)
    # Bounded calls first, as on a CPU whose one-call GEMM changes a row's bits past 32 rows
    # (where CI runs); a CPU that keeps them at every count would otherwise prove one call.
    offered = engine_module.candidates
    monkeypatch.setattr(engine_module, "candidates", lambda device, tile: offered(device, tile)[1:])
    llm = LLM(str(trained_model), num_kv_blocks=512, **BF16)
    engine = llm.llm_engine
    assert engine.get_stats()["gemm_paths"]["384x1024"] == "cpu:max32"
    splits.clear()  # the self-test's
    engine.add_request("det", PROMPT, det(logprobs=3))
    steps, done = 0, None
    while engine.has_unfinished_requests():
        if steps % 6 == 1 and steps < 30:  # a long prompt arrives beside the deterministic decode rows
            prompt = f"# request {steps}\n" + "import numpy as np\n" * 20
            engine.add_request(f"n{steps}", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=steps))
        done = next((o for o in engine.step() if o.request_id == "det" and o.finished), done)
        steps += 1
    ref = reference["logprobs"].outputs[0]
    assert done is not None and done.outputs[0].token_ids == ref.token_ids
    assert done.outputs[0].logprobs == ref.logprobs  # bit-identical floats, ranks and top-3 sets
    assert any(count < 4 and rows - count > 100 for count, rows in splits), splits


def test_gemms_run_only_the_canonical_rows_on_a_proven_path_that_is_not_the_fast_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixed pass gives its canonical rows the proven path's bits, padded to a proven size
    and as the shape's padding table says, and the other rows the fast path's, in one call each."""
    monkeypatch.setattr(FAULTS, "fast_gemm_noise", 0.05)  # the fast path's bits depend on its row count
    gen = torch.Generator().manual_seed(0)
    down = torch.randn(384, 1024, generator=gen).bfloat16()
    up = torch.randn(1024, 384, generator=gen).bfloat16()
    bounded, fast = GemmPath("cpu", max_rows=32), GemmPath("cpu")
    sizes = PassSizes.grid(1, 512, 8, cover=True)
    assert prove(bounded, down, None, sizes.sizes) is None and prove(fast, up, None, sizes.sizes) is None
    shape = (384, 1024, False)
    gemms = Gemms(fast, {shape: bounded, (1024, 384, False): fast}, padding={shape: {4: 12}}, sizes=sizes)
    calls: list[tuple[GemmPath, int]] = []
    monkeypatch.setattr(gemm, "run", lambda path, x, w, b=None: calls.append((path, len(x))) or run(path, x, w, b))
    x = torch.randn(300, 1024, generator=gen).bfloat16()
    flags = np.zeros(300, dtype=bool)
    for canonical in ([3, 40, 41, 299], [*range(120, 137)], []):
        flags[:] = False
        flags[canonical] = True
        split = gemms.split_of(flags, x.device)
        assert isinstance(split.canonical, slice) == (len(canonical) != 4)
        gemms.select(True, split)
        calls.clear()
        out = gemms.linear(x, down)
        padded = max(sizes.fit(len(canonical)), 12) if canonical else 0
        assert calls == [(fast, 300 - len(canonical)), *([(bounded, padded)] * bool(canonical))]
        assert torch.equal(out[flags], run(bounded, x, down)[flags])  # the bits of a pass all on the proven path
        others = run(fast, x[~flags], down)
        assert torch.equal(out[~flags], others + batch_noise(others, 0.05))
        calls.clear()
        h = x[:, :384].contiguous()
        assert torch.equal(gemms.linear(h, up), run(fast, h, up)) and calls == [(fast, 300)]  # proven = fast: one call
    assert gemms.split_of(np.ones(300, dtype=bool), x.device) is None  # every row canonical: no split


def test_proven_gemms_pad_each_small_row_count_as_its_table_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call of n rows takes the padding timed for the smallest row count at or above n (none
    where that count was quickest unpadded, or where n is above every count timed), and a
    padded call gives its rows the bits of the unpadded one."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    shape, path = (96, 64, False), GemmPath("cpu")
    assert prove(path, w, None, range(1, 17)) is None
    gemms = Gemms(path, {shape: path}, padding={shape: {1: 8, 2: 2, 4: 8, 8: 16}})
    assert [gemms.padded_rows(shape, n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [8, 2, 8, 8, 16, 16, 9, 16]
    assert gemms.padded_rows((64, 96, False), 1) == 1  # a shape that pads nothing
    calls: list[int] = []
    monkeypatch.setattr(gemm, "run", lambda p, x, w, b=None: calls.append(len(x)) or run(p, x, w, b))
    gemms.select(True)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(gemms.linear(x, w), run(path, x, w)) and calls == [16]


def test_the_fast_lane_takes_its_quick_path_by_row_count_but_never_in_a_canonical_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fast-lane call of n rows takes the path timed quickest for the smallest power of two
    at or above n (``fast`` above every count timed, and for shapes without a table); a
    canonical pass on the fast path keeps ``fast`` at every row count; and a lane with such
    a table no longer counts as running its proven paths."""
    gen = torch.Generator().manual_seed(3)
    w, other = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(64, 64, generator=gen).bfloat16()
    fast, tiled, bounded = GemmPath("cpu"), GemmPath("cpu", tile=16), GemmPath("cpu", max_rows=32)
    gemms = Gemms(fast, {(96, 64, False): fast, (64, 64, False): fast})
    assert gemms.fast_is_proven()
    gemms.quick = {(96, 64, False): {1: tiled, 2: fast, 4: bounded, 8: fast, 16: fast, 32: fast, 64: tiled}}
    assert not gemms.fast_is_proven()
    calls: list[GemmPath] = []
    monkeypatch.setattr(gemm, "run", lambda p, x, w, b=None: calls.append(p) or run(p, x, w, b))
    gemms.select(False)
    for n, expected in ((1, tiled), (2, fast), (3, bounded), (4, bounded), (5, fast), (33, tiled), (64, tiled),
                        (65, fast)):
        calls.clear()
        x = torch.randn(n, 64, generator=gen).bfloat16()
        assert torch.equal(gemms.linear(x, w), run(expected, x, w)) and calls == [expected], n
    calls.clear()
    gemms.linear(torch.randn(1, 64, generator=gen).bfloat16(), other)
    assert calls == [fast]  # a shape without a table
    gemms.select(False, canonical=True)
    calls.clear()
    gemms.linear(torch.randn(1, 64, generator=gen).bfloat16(), w)
    assert calls == [fast]


def test_a_one_call_proven_path_runs_every_row_of_a_mixed_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the proven path is one call (cuBLAS on a GPU), a mixed pass runs all its rows on it,
    in one call: a split would cost two calls and the row gathers; a pass without canonical
    rows keeps the fast path."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    fast, proven = GemmPath("cpu", tile=7), GemmPath("cpu")  # the fast path as the tile fault makes it
    sizes = PassSizes.grid(1, 512, 8, cover=True)
    gemms = Gemms(fast, {(96, 64, False): proven}, sizes=sizes)
    calls: list[tuple[GemmPath, int]] = []
    monkeypatch.setattr(gemm, "run", lambda path, x, w, b=None: calls.append((path, len(x))) or run(path, x, w, b))
    x = torch.randn(300, 64, generator=gen).bfloat16()
    for canonical, expected in (([3, 40, 299], [(proven, 300)]), ([], [(fast, 300)])):
        flags = np.zeros(300, dtype=bool)
        flags[canonical] = True
        split = gemms.split_of(flags, x.device)
        assert (split is None) == bool(canonical)  # no bounded path: nothing to split, no row index uploaded
        gemms.select(True, split)
        calls.clear()
        out = gemms.linear(x, w)
        assert calls == expected
        assert torch.equal(out, run(expected[0][0], x, w))


@pytest.mark.parametrize("strategy", ["speculate", "direct", "whole"])
def test_windowed_strategies_give_the_riding_bits(
    trained_model: Path, reference: dict, faults: None, strategy: str
) -> None:
    """With proven GEMMs a canonical pass may have any size, so the windowed lane computes
    the same bits as riding rows: same tokens, same fingerprint."""
    llm = LLM(str(trained_model), num_kv_blocks=512, determinism_strategy=strategy, **BF16)
    outs = llm.generate(
        [PROMPT, PROMPT, *CROWD], [det(), det(temperature=0.9, top_p=0.95, seed=5), *crowd_params(len(CROWD))],
        use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == reference["greedy"]
    assert outs[1].outputs[0].token_ids == reference["seeded"]
    assert outs[0].fingerprint == reference["fingerprint"]
    stats = llm.llm_engine.get_stats()
    assert stats["determinism"] == "windowed" and stats["strategy_choices"][strategy] > 0
    assert stats["canonical_pass_sizes"][0] == 1


SETTINGS = [
    dict(num_kv_blocks=96),
    dict(max_num_seqs=2),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),
    dict(block_size=8),
    dict(async_scheduling=True),
    dict(canonical_sizes_per_octave=2),
]


def test_same_bits_under_other_settings_and_in_a_fresh_process(trained_model: Path, reference: dict) -> None:
    fingerprints = set()
    for settings in SETTINGS:
        llm = LLM(str(trained_model), **BF16, **settings)
        assert llm.llm_engine.ride, settings
        outs = llm.generate([PROMPT, *CROWD[:3]], [det(), *crowd_params(3)], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == reference["greedy"], settings
        fingerprints.add(outs[0].fingerprint)
    assert fingerprints == {reference["fingerprint"]}
    tokens, fingerprint = fresh_process_output(trained_model, **BF16)
    assert tokens == reference["greedy"] and fingerprint == reference["fingerprint"]


def test_preemption_keeps_a_riding_request_output(trained_model: Path, reference: dict, faults: None) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=20, block_size=8, **BF16)
    long_crowd = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate([*CROWD[:4], PROMPT], [*long_crowd, det()], use_tqdm=False)  # arriving last: first victim
    assert llm.llm_engine.get_stats()["preemptions"] > 0
    assert outs[4].outputs[0].token_ids == reference["greedy"]
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs[:4])


def test_riding_requests_share_canonical_prefix_blocks_only(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=256, **BF16)
    prompt = "import numpy as np\n" * 12 + PROMPT
    assert llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].num_cached_tokens == 0
    first = llm.generate(prompt, det(8), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # the normal request's blocks are fast-lane numerics
    second = llm.generate(prompt, det(8), use_tqdm=False)[0]
    assert second.num_cached_tokens >= 48 and second.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_riding_pass_is_padded_to_a_proven_size(trained_model: Path) -> None:
    llm = LLM(str(trained_model), num_kv_blocks=64, **BF16)
    runner = llm.llm_engine.runner
    deterministic = synthetic_request("d", list(range(40)), 40, "canonical")
    normal = synthetic_request("n", list(range(3, 30)), 27, "fast", deterministic=False)
    chunks = [ScheduledChunk(normal, 0, 27), ScheduledChunk(deterministic, 30, 10)]
    rows = runner._rows(chunks, canonical=False, ride=True)
    size = runner.canonical.fit(37)
    assert size > 37 and len(rows.input_ids) == size and rows.pad == size - 37
    assert rows.canonical_seqs == [0, 1, 0]  # the normal chunk, the deterministic one, the padding
    assert rows.logit_rows == [26, 36] and rows.logit_pad == 0  # 2 rows: a proven size already
    alone = runner._rows([ScheduledChunk(deterministic, 0, 37)], canonical=False, ride=True)
    assert alone.pad == size - 37 and alone.canonical_seqs == [1, 1]  # all canonical: the padding too, so no split
    fast = runner._rows(chunks, canonical=False, ride=False)
    assert fast.pad == 0 and fast.canonical_seqs is None


def test_without_a_proof_the_windowed_lane_serves(trained_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FAULTS, "no_invariant_gemms", True)
    llm = LLM(str(trained_model), num_kv_blocks=128)
    stats = llm.llm_engine.get_stats()
    assert stats["determinism"] == "windowed" and stats["gemm_paths"] == {}
    assert llm.llm_engine.canonical_rows == 32 and llm.llm_engine.numerics["gemms"] == "cpu"
    with pytest.raises(ValueError, match="determinism_strategy='ride' needs GEMMs"):
        LLM(str(trained_model), num_kv_blocks=128, determinism_strategy="ride")


def test_gemm_proof_tells_invariant_paths_from_others() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=gen)
    sizes = PassSizes.grid(1, 512, 8, cover=True).sizes
    broken = prove(GemmPath("cpu"), weight, None, sizes)  # float32 changes a row's bits from 4 rows on
    assert broken is not None and "changes bits" in broken
    broken = prove(GemmPath("cpu", max_rows=32), weight, None, sizes)  # so at most 32 rows a call is no cure
    assert broken is not None and "changes bits" in broken
    assert prove(GemmPath("cpu", 16), weight, None, sizes) is None
    plan, failures = prove_plan([(weight, None), (weight, None)], candidates(torch.device("cpu"), 16), list(sizes))
    assert plan == {(256, 384, False): GemmPath("cpu", 16)} and list(failures) == ["256x384 cpu", "256x384 cpu:max32"]
    assert prove_plan([(weight, None)], (GemmPath("cpu"),), list(sizes))[0] is None
    decided = {(256, 384, False): GemmPath("cpu")}  # a path chosen elsewhere is still proven on these weights
    assert prove_plan([(weight, None)], candidates(torch.device("cpu"), 16), list(sizes), decided)[0] is None
    x = torch.randn(70, 384, generator=gen)  # the bounded path: calls of 32, 32 and 6 rows, none padded
    want = torch.cat([torch.nn.functional.linear(part, weight) for part in x.split(32)])
    assert torch.equal(run(GemmPath("cpu", max_rows=32), x, weight), want)


def test_riding_rows_that_see_their_company_make_the_self_test_refuse(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FAULTS, "canonical_cross_row", 1e-3)
    with pytest.raises(DeterminismSelfTestError, match="not independent on this machine"):
        LLM(str(trained_model), num_kv_blocks=64, **BF16)


def test_a_self_test_with_no_room_names_the_settings(trained_model: Path) -> None:
    with pytest.raises(DeterminismSelfTestError, match=r"max_model_len=2 .*\(num_kv_blocks"):
        LLM(str(trained_model), num_kv_blocks=64, max_model_len=2, **BF16)


def test_the_self_test_probe_crosses_the_backend_split_boundaries(
    trained_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend whose canonical schedule splits a row's keys (Triton's: 256 keys) asks for
    a probe long enough to cross a split; the self-test runs it, and passes."""
    lengths: list[int] = []
    init = selftest.SelfTest.__init__

    def record(test: selftest.SelfTest, *args: Any) -> None:
        init(test, *args)
        lengths.append(test.n)

    monkeypatch.setattr(selftest.SelfTest, "__init__", record)
    monkeypatch.setattr(TorchAttentionBackend, "probe_keys", property(lambda backend: 150))
    LLM(str(trained_model), num_kv_blocks=64, **BF16)
    assert lengths == [150]  # 101 tokens otherwise


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "seed", "dtype"),
    [(8, 8, 8, 2, "bfloat16"), (4, 4, 16, 0, "float32"), (8, 4, 16, 0, "bfloat16")],
    ids=["one-query-head-per-kv-head-bf16", "one-query-head-per-kv-head-fp32", "8-heads-4-kv-heads-16-dims-bf16"],
)
def test_head_groupings_pass_the_self_test_and_ride(
    heads: int, kv_heads: int, head_dim: int, seed: int, dtype: str, tmp_path: Path, tokenizer_dir: Path, faults: None
) -> None:
    """Groupings the shared fixtures lack: starting the engine runs the self-test, and a
    deterministic request then gets the same tokens and logprobs beside normal rows as alone.
    The first model's o_proj is a 64x64 bf16 GEMM whose bits change between 1 and 2 rows in a
    few outputs only: a GEMM proof that compared each size on the rows of one call passed it,
    and the self-test refused to start."""
    shape = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    write_checkpoint(tmp_path, "LlamaForCausalLM", seed=seed, tokenizer=False, **shape)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    llm = LLM(str(tmp_path), num_kv_blocks=64, device="cpu", dtype=dtype)
    assert llm.llm_engine.get_stats()["determinism"] == "ride"
    alone = llm.generate(PROMPT, det(6, logprobs=2), use_tqdm=False)[0].outputs[0]
    prompts, params = [*CROWD[:2], PROMPT, *CROWD[2:]], [*crowd_params(2), det(6, logprobs=2), *crowd_params(3)]
    beside = llm.generate(prompts, params, use_tqdm=False)[2].outputs[0]
    assert beside.token_ids == alone.token_ids
    assert beside.logprobs == alone.logprobs


def test_column_proof_refuses_a_gemm_whose_columns_change_with_their_company(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TP-invariant proof of a column-parallel GEMM: shards of a 12-head qkv at TP 1, 2
    and 4 (the last one's rows not contiguous, as a rank's q, k and v are). The CPU's tiled
    path passes; a GEMM that moves a column by one ulp whenever it runs beside fewer columns
    than the whole is refused, naming it."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    shards = [torch.arange(96), torch.arange(48), torch.cat([torch.arange(8, 16), torch.arange(40, 64)])]
    sizes = PassSizes.grid(1, 64, 4, cover=True).sizes
    tiled = GemmPath("cpu", 16)
    assert prove_columns(tiled, weight, bias, 96, shards, sizes) is None
    linear = torch.nn.functional.linear

    def company(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = linear(x, w, b)
        return out if w.shape[0] == 96 else torch.nextafter(out, torch.full_like(out, torch.inf))

    monkeypatch.setattr(torch.nn.functional, "linear", company)
    broken = prove_columns(tiled, weight, bias, 96, shards, sizes)
    assert broken == "a column changes bits between calls of 96 and 48 columns"


def test_gemm_proof_compares_every_size_on_many_outputs() -> None:
    """A bf16 GEMM rounds away most of a change in its summation order: on this CPU a 64x64
    one gives a few outputs in 10^5 other bits in calls of 1 row than in calls of more. Any
    path the proof accepts keeps every output's bits over 8,192 rows in calls of each size."""
    gen = torch.Generator().manual_seed(0)
    weight = (0.1 * torch.randn(64, 64, generator=gen)).to(torch.bfloat16)
    x = torch.randn(8192, 64, generator=gen).to(torch.bfloat16)
    sizes = [1, 2, 4, 8, 16, 32]
    accepted = [path for path in candidates(torch.device("cpu"), 16) if prove(path, weight, None, sizes) is None]
    assert accepted
    for path in accepted:
        alone = torch.cat([run(path, part, weight) for part in x.split(1)])
        for m in sizes[1:]:
            assert torch.equal(torch.cat([run(path, part, weight) for part in x.split(m)]), alone), f"{path}, {m} rows"
