"""Tensor parallelism on the CPU (gloo): same tokens and logits as one rank, determinism at
TP=2 and TP=4, and a dead worker that fails the engine quickly instead of hanging it.
Every engine is pinned to the CPU, so a GPU host runs these float32 checks as CI does.

Every engine here is shut down before the next starts: one process holds one group.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, replace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sid import LLM, SamplingParams
from sid.engine.engine import LLMEngine
from sid.engine.fingerprint import weights_digest
from sid.engine.inputs import DEFAULT_DETERMINISTIC_SEED
from sid.engine.selftest import DeterminismSelfTestError
from sid.model.builtin import write_checkpoint
from sid.receipts import make_receipt, replay
from sid.runtime.distributed import STEP, ControlChannel, ControlReceiver
from sid.runtime.faults import FAULTS
from sid.runtime.model_runner import StepInputs
from sid.runtime.tp_worker import TPGroupError
from tests.test_determinism import CROWD, PROMPT, crowd_params, det
from tests.test_models import PROMPTS, assert_close, hf_logits, record_logits


@contextmanager
def tp_llm(path: Path, tp: int, **kwargs: object) -> Iterator[LLM]:
    """An LLM at ``tp`` ranks (one process at 1) whose workers are gone (checked) once the block ends."""
    llm = LLM(str(path), tensor_parallel_size=tp, device="cpu", **kwargs)
    workers = llm.llm_engine.workers
    assert len(workers.procs) == tp - 1 if workers is not None else tp == 1
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()
        assert workers is None or all(p.poll() is not None for p in workers.procs.values())
        assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("overlap", "graphs"), [(False, False), (True, False), (True, True)], ids=["lockstep", "overlapped", "graphs"]
)
def test_tp2_greedy_tokens_equal_tp1_on_the_trained_model(trained_model: Path, overlap: bool, graphs: bool) -> None:
    """Also with overlapped scheduling, where a step's input ids are placeholders until rank 0
    resolves them on the device and broadcasts them to the worker; and through the CUDA
    graphs' path (``capture_graphs``: on the CPU every rank builds the graphs' buffers and
    computes what a replay would): decode steps padded to their bucket, prompt passes to a
    piece bucket, each rank loading the plan into its own buffers."""
    prompts = ["def main(", "import numpy as np\n", "class Config:\n    def __init__(self", "    for i in range("]
    # Two ~800-token prompts make a first step whose plan needs more than one broadcast.
    prompts += ["".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(k, k + 60)) for k in (0, 100)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    settings = dict(num_kv_blocks=256, max_num_batched_tokens=2048)
    one = LLM(str(trained_model), device="cpu", **settings)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with tp_llm(trained_model, 2, async_scheduling=overlap, **settings) as two:
        engine = two.llm_engine
        assert engine.async_scheduling == overlap
        tp, broadcasts = engine.model.tp, []
        send = tp.broadcast_from_first
        tp.broadcast_from_first = lambda ids: broadcasts.append(len(ids)) or send(ids)
        replays: list[bool] = []
        if graphs:
            engine.capture_graphs()
            runner = engine.runner
            assert runner.graphs is not None and runner.pieces is not None
            replay, run = runner._replay, runner.pieces.run
            runner._replay = lambda step, fed: replays.append(True) or replay(step, fed)  # type: ignore
            runner.pieces.run = lambda rows, bucket: replays.append(False) or run(rows, bucket)  # type: ignore
        start, plans = time.perf_counter(), engine.workers.plans_sent
        outs = two.generate(prompts, params, use_tqdm=False)
        elapsed, plans = time.perf_counter() - start, engine.workers.plans_sent - plans
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Every pass went through a graph's path: decode steps replay, prompt passes run pieces.
        assert not graphs or (len(replays) == plans and replays.count(True) >= 20 and replays.count(False) >= 1)
        # Overlapped: nearly every decode step's ids came from the device (the first and the
        # drains before a finish read real tokens); in lockstep none did.
        assert len(broadcasts) >= (20 if overlap else 0) and (overlap or not broadcasts)
        assert engine.fingerprint != one.llm_engine.fingerprint
        assert engine.numerics["tensor_parallel_size"] == 2
        w = engine.workers
        print(
            f"\nTP=2: {plans} passes, {1e3 * elapsed / plans:.2f} ms per pass; sending a plan took "
            f"{1e6 * w.plan_seconds / w.plans_sent:.0f} us on rank 0 (mean over {w.plans_sent})"
        )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_logits_match_transformers(family: str, checkpoints: dict[str, Path]) -> None:
    """Split and replicated KV heads (Mistral's one is replicated), tied and untied heads, qkv bias, q/k norm."""
    path = checkpoints[family]
    with tp_llm(path, 2, num_kv_blocks=64, max_num_batched_tokens=11, enable_determinism=False) as llm:
        seen = record_logits(llm)
        prompt = PROMPTS[0]
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
        ids = llm.get_tokenizer()(prompt).input_ids
        assert_close(torch.cat(seen), hf_logits(path, ids))


@pytest.mark.parametrize(("tp", "lane"), [(2, "ride"), (4, "ride"), (2, "windowed")])
def test_deterministic_request_is_identical_across_batch_compositions(
    tp: int, lane: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows riding beside others (every rank on rank 0's proven GEMM paths, fixed-order sums in
    their passes) and the windowed lane: the same bits alone and in a crowd, under faults."""
    if lane == "windowed":
        monkeypatch.setattr(FAULTS, "no_invariant_gemms", True)
    path = checkpoints["llama"]
    with tp_llm(path, tp, num_kv_blocks=256) as llm:  # constructing it ran the self-test
        assert llm.llm_engine.get_stats()["determinism"] == lane
        alone = llm.generate(PROMPT, det(16, logprobs=2), use_tqdm=False)[0].outputs[0]
        monkeypatch.setattr(FAULTS, "fast_lane_logit_noise", 3.0)
        monkeypatch.setattr(FAULTS, "fast_attention_noise", 0.5)
        crowd = crowd_params(4)
        prompts = [*CROWD[:2], PROMPT, *CROWD[2:4]]
        outs = llm.generate(prompts, [*crowd[:2], det(16, logprobs=2), *crowd[2:]], use_tqdm=False)
        assert outs[2].outputs[0].token_ids == alone.token_ids
        assert outs[2].outputs[0].logprobs == alone.logprobs  # bit-identical canonical logits
        stats = llm.llm_engine.get_stats()
        if lane == "ride":
            assert stats["strategy_choices"]["ride"] > 0 and stats["verifications"] == 0
        else:
            assert stats["rollbacks"] > 0  # the faults reached the proposals


@pytest.fixture(scope="module")
def grouped_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A Llama whose 4 KV heads split 1, 2 and 4 ways with 2 query heads each."""
    path = tmp_path_factory.mktemp("grouped")
    write_checkpoint(
        path, "LlamaForCausalLM", seed=5, tokenizer=False, num_attention_heads=8, num_key_value_heads=4, head_dim=8
    )
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_tp_invariant_chunks_give_the_same_bits_and_receipts_at_tp_1_2_and_4(grouped_llama: Path) -> None:
    """With the row-parallel K split into 4 chunks summed in one tree, deterministic requests
    (greedy and seeded) get the same tokens and logprobs at every TP size, under one
    fingerprint: receipts written at TP=1 replay at TP=2 and 4. Without the option, TP=2
    misses them, and its fingerprint names its TP size."""
    prompts = ["def main(", "import os\n"]
    params = [det(12, logprobs=2), det(12, temperature=1.0, seed=3, logprobs=2)]
    seeds = [DEFAULT_DETERMINISTIC_SEED, 3]

    def run(tp: int, chunks: int | None, receipts: tuple[dict, ...] = ()) -> tuple[list, str, list[dict], list[bool]]:
        small = dict(num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=8)  # a quick start-up proof
        with tp_llm(grouped_llama, tp, tp_invariant_chunks=chunks, **small) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            engine = llm.llm_engine
            replayed = [replay(engine, r).match for r in receipts]
        written = [make_receipt(o, p, seed, str(grouped_llama)) for o, p, seed in zip(outs, params, seeds)]
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], engine.fingerprint, written, replayed

    one, fingerprint, receipts, _ = run(1, 4)
    for tp in (2, 4):
        outs, other, _, replayed = run(tp, 4, tuple(receipts))
        assert outs == one and other == fingerprint and replayed == [True, True], f"TP={tp}"
    outs, other, _, _ = run(2, None)
    assert outs != one and other != run(1, None)[1]


def test_dummy_weights_of_another_tp_size_are_another_model(grouped_llama: Path) -> None:
    """Each rank draws its dummy shard for itself, so TP=2's random model is not TP=1's: their
    weights digests differ, and no fingerprint lets one's receipts replay on the other."""
    assert weights_digest(grouped_llama, "dummy", 0, 1) != weights_digest(grouped_llama, "dummy", 0, 2)
    assert weights_digest(grouped_llama, "auto", 0, 1) == weights_digest(grouped_llama, "auto", 0, 2)


def test_self_test_refuses_at_tp2_and_stops_the_workers(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FAULTS, "canonical_cross_row", 1e-3)
    with pytest.raises(DeterminismSelfTestError, match="not independent"):
        LLM(str(checkpoints["qwen2"]), num_kv_blocks=64, tensor_parallel_size=2, device="cpu")
    assert not dist.is_initialized()


@contextmanager
def failed_step(
    path: Path, tp: int, fault: Callable[[LLMEngine], object], match: str, **settings: object
) -> Iterator[tuple[LLMEngine, float]]:
    """An engine at ``tp`` ranks that ran one step, then met ``fault``, then a step that failed
    with a ``TPGroupError`` matching ``match``: yields it and the seconds that step took, so
    each fault test times the same sequence and checks what the engine does afterwards."""
    with tp_llm(path, tp, num_kv_blocks=64, enable_determinism=False, load_format="dummy", **settings) as llm:
        engine = llm.llm_engine
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))
        engine.step()
        fault(engine)
        start = time.monotonic()
        with pytest.raises(TPGroupError, match=match):
            engine.step()
        yield engine, time.monotonic() - start


def test_killed_worker_fails_the_next_step_within_seconds(checkpoints: dict[str, Path]) -> None:
    def kill(engine: LLMEngine) -> None:
        os.kill(engine.workers.pids[2], signal.SIGKILL)

    with failed_step(checkpoints["qwen3"], 4, kill, r"worker rank 2 died \(exit code -9\)") as (engine, elapsed):
        assert elapsed < 5
        print(f"\nthe step after the kill failed in {elapsed:.2f} s")
        assert all(p.poll() is not None for p in engine.workers.procs.values())  # the others were stopped
        with pytest.raises(TPGroupError, match="rank 2 died"):
            engine.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["lockstep", "overlapped"])
def test_worker_that_dies_during_a_collective_fails_the_step_within_seconds(
    checkpoints: dict[str, Path], overlap: bool
) -> None:
    """Rank 0 is already waiting in the step's first collective when the worker dies: the
    broken connection, not the 120 s timeout, ends the wait. Overlapped, that collective is
    the broadcast of the step's input ids."""

    def stop_then_kill(engine: LLMEngine) -> None:
        pid = engine.workers.pids[1]
        os.kill(pid, signal.SIGSTOP)  # it takes the plan but never joins the collective
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()

    died = r"worker rank 1 died \(exit code -9\)"
    with failed_step(checkpoints["qwen3"], 2, stop_then_kill, died, async_scheduling=overlap) as (_, elapsed):
        assert 0.5 <= elapsed < 5
        print(f"\nthe step whose worker died in it failed after {elapsed:.2f} s")


def test_hung_worker_times_out_the_step_with_a_clear_error(checkpoints: dict[str, Path]) -> None:
    """A stopped worker never joins the next collective: rank 0 gives up after the timeout,
    says it was a hang, and stops the workers (the hung one by force)."""

    def stop(engine: LLMEngine) -> None:
        os.kill(engine.workers.pids[1], signal.SIGSTOP)

    match = r"collective timed out: rank 0 waited 2 s \(collective_timeout_s\)"
    with failed_step(checkpoints["qwen3"], 2, stop, match, collective_timeout_s=2.0) as (engine, elapsed):
        assert 2 <= elapsed < 10
        print(f"\nthe step with a hung worker failed after {elapsed:.2f} s")
        assert all(p.poll() is not None for p in engine.workers.procs.values())
        with pytest.raises(TPGroupError, match="timed out"):
            engine.check_health()


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(trained_model: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's attention heads"):
        LLM(str(trained_model), tensor_parallel_size=4, device="cpu")
    assert not dist.is_initialized()


def _plan(keys: list[int], rows: list[list[int]], **fields: object) -> StepInputs:
    """A decode plan: one row per sequence, ``rows`` its blocks (zero-padded to a table)."""
    table = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
    for i, blocks in enumerate(rows):
        table[i, : len(blocks)] = blocks
    n = len(keys)
    lens = [16 * len(blocks) - i for i, blocks in enumerate(rows)]
    step = StepInputs(
        input_ids=[7 * k + 1 for k in range(n)],
        positions=[length - 1 for length in lens],
        slots=np.arange(n, dtype=np.int64) + 100,
        block_tables=table,
        seq_lens=lens,
        query_start_loc=list(range(n + 1)),
        canonical=False,
        logit_rows=list(range(n)),
        seq_keys=keys,
    )
    return replace(step, **fields)


def test_plan_channel_sends_changed_table_entries_and_rebuilds_every_plan() -> None:
    """Sequences that grow a block, leave, arrive, change places or repeat a key (self-test
    probes), a padding row, and each flag: the worker decodes exactly rank 0's plan."""
    read, write = os.pipe()
    sender, receiver = ControlChannel([write]), ControlReceiver(read)
    base = [list(range(10 * k, 10 * k + 6)) for k in range(8)]
    plans = [
        _plan(list(range(8)), base),
        _plan(list(range(8)), [b + [90 + i] if i % 3 == 0 else b for i, b in enumerate(base)]),  # some take a block
        _plan([5, 1, 9, 0], [base[5], base[1], [70, 71], base[0] + [90]], canonical=True, logit_rows=None),
        _plan([0, 0, -1], [base[0] + [90], [3, 4], [0]], canonical_seqs=[1, 0, 0], invariant=True, logit_rows=[]),
    ]
    try:
        sizes = []
        for plan in plans:
            before = sender.ints_sent
            sender.send_step(plan)
            sizes.append(sender.ints_sent - before)
            kind, got = receiver.recv()
            assert kind == STEP and isinstance(got, StepInputs)
            sent, received = asdict(plan), asdict(got)
            for name in ("slots", "block_tables"):
                assert np.array_equal(sent.pop(name), received.pop(name)), name
            sent.pop("seq_keys")
            received.pop("seq_keys")
            assert received == sent
        # A header, then per sequence its id, position, slot, length, start, logit row and
        # previous row (and one more start): the first plan adds whole rows of 6 blocks, the
        # second only the 3 entries that changed (index and value).
        layout = 8 + 7 * 8 + 1
        assert sizes[:2] == [layout + 8 * 6, layout + 2 * 3]
    finally:
        sender.close()
        os.close(read)
