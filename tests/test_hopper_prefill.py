"""``hopper_prefill``: the fast schedule's prompt attention on sm_90, in Gluon.

Gluon has no interpreter, so the kernel's numbers are checked on an sm_90 GPU only, against
``paged_attention_ref`` (which CI runs as the Triton kernels' reference). On the CPU,
``test_kernels.py`` compiles the kernel for sm_90a (shared memory, registers, spills) and the
plan's choice of it is checked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sid.kernels import hopper_prefill
from sid.kernels import paged_attention as attention
from sid.kernels.attention_ref import paged_attention_ref, store_kv_ref

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 only (its plan is checked on CPU)")
SHAPES = [(0, 700), (1000, 130), (77, 1), (0, 0), (3000, 37), (5, 3), (200, 64), (64, 200), (12200, 300)]
"""(cached prefix, chunk) of each sequence: fresh prompts, chunks after a prefix, one-row and
empty chunks, chunks whose last tile reaches past the sequence from cached keys, and rows on
both sides of a canonical split size's doubling (12,288 keys)."""
CANONICAL = 1
"""The sequence flagged canonical (in the fast launch; the only fast one in the canonical)."""


class Step:
    """A step's tensors as the engine passes them: a NaN-poisoned cache of ``block_size`` slots
    a block holding every context in shuffled blocks (table entries past a sequence: -1 or
    junk), and the step's q and own K/V as views of a fused projection with a NaN column block."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(heads * head_dim + block_size)
        lens = [prefix + chunk for prefix, chunk in SHAPES]
        blocks = [-(-n // block_size) for n in lens]
        cache_shape = (sum(blocks) + 3, block_size, kv_heads, head_dim)
        k_cache = torch.full(cache_shape, float("nan"), dtype=torch.bfloat16)
        v_cache = torch.full(cache_shape, float("nan"), dtype=torch.bfloat16)
        order = torch.randperm(cache_shape[0], generator=gen).tolist()
        tables = torch.full((len(SHAPES), max(blocks) + 2), -1, dtype=torch.int32)
        tokens = sum(chunk for _, chunk in SHAPES)
        fused = torch.full((tokens, heads + 2 * kv_heads + 1, head_dim), float("nan"), dtype=torch.bfloat16)
        row = 0
        for s, (prefix, chunk) in enumerate(SHAPES):
            table = [order.pop() for _ in range(blocks[s])]
            tables[s, : blocks[s]] = torch.tensor(table, dtype=torch.int32)
            if s % 2:
                tables[s, blocks[s] :] = 1 << 30
            keys, values = (torch.randn(lens[s], kv_heads, head_dim, generator=gen) for _ in range(2))
            pos = torch.arange(lens[s])
            slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
            store_kv_ref(keys, values, k_cache, v_cache, slots)
            fused[row : row + chunk, :heads] = torch.randn(chunk, heads, head_dim, generator=gen)
            fused[row : row + chunk, heads : heads + kv_heads] = keys[prefix:]
            fused[row : row + chunk, heads + kv_heads : heads + 2 * kv_heads] = values[prefix:]
            row += chunk
        self.heads, self.kv_heads = heads, kv_heads
        self.fused = fused.to(device)
        self.k_cache, self.v_cache, self.block_tables = k_cache.to(device), v_cache.to(device), tables.to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0, *(c for _, c in SHAPES)], device=device).cumsum(0).to(torch.int32)
        self.flags = torch.zeros(len(SHAPES), dtype=torch.int32, device=device)
        self.flags[CANONICAL] = 1

    @property
    def q(self) -> torch.Tensor:
        return self.fused[:, : self.heads]

    @property
    def k(self) -> torch.Tensor:
        return self.fused[:, self.heads : self.heads + self.kv_heads]

    @property
    def v(self) -> torch.Tensor:
        return self.fused[:, self.heads + self.kv_heads : self.heads + 2 * self.kv_heads]

    def reference(self) -> torch.Tensor:
        return paged_attention_ref(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                   self.query_start_loc, self.q.shape[-1] ** -0.5)  # fmt: skip

    def rows_of(self, seqs: range | list[int]) -> torch.Tensor:
        """Query rows of the sequences ``seqs``."""
        starts = self.query_start_loc.tolist()
        return torch.tensor([r for s in seqs for r in range(starts[s], starts[s + 1])], dtype=torch.long)


def _plan(step: Step, **kw: object) -> attention.AttentionPlan:
    return attention.plan_attention(
        step.q, step.k_cache, step.block_tables, step.seq_lens, step.query_start_loc, own_keys=True, **kw
    )


def _hopper(plan: attention.AttentionPlan) -> list[attention._Launch]:
    return [one for one in plan.launches if one.sched.hopper]


def test_prompt_launches_take_the_hopper_kernel_where_it_fills_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel supports the step (an sm_90 device), a prompt launch of either schedule
    whose query blocks fill the multiprocessors runs as it, with no partials (the canonical one
    folds a row's splits in one program); decode launches, launches without the pass's own keys
    and thin ones keep the Triton kernel."""
    monkeypatch.setattr(hopper_prefill, "supports", lambda q, k_cache: True)
    monkeypatch.setattr(attention, "HOPPER_PREFILL", True)
    step = Step(8, 2, 64, 16, torch.device("cpu"))
    plan = _plan(step, canonical=False)
    assert [one.serve for one in _hopper(plan)] == [attention._SERVE_FAST] and plan.slots == 1
    canonical = _plan(step, canonical=True)
    assert [one.serve for one in _hopper(canonical)] == [attention._SERVE_CANONICAL] and canonical.slots == 1
    assert canonical.launches[0].sched.max_splits > 1, "the step's long rows have several splits"
    riding = _plan(step, canonical=step.flags)
    assert [one.serve for one in riding.launches] == [attention._SERVE_CANONICAL, attention._SERVE_FAST]
    assert len(_hopper(riding)) == 2 and riding.slots == 1
    decode = attention.plan_attention(step.q[:1], step.k_cache, step.block_tables[2:3], step.seq_lens[2:3],
                                      torch.tensor([0, 1], dtype=torch.int32), canonical=False, own_keys=True)
    assert not _hopper(decode)
    none_own = attention.plan_attention(step.q, step.k_cache, step.block_tables, step.seq_lens,
                                        step.query_start_loc, canonical=False)  # fmt: skip
    assert not _hopper(none_own)
    blocks = attention._query_blocks(step.q.shape[0], len(SHAPES), 700, hopper_prefill.BLOCK_M // 4)
    monkeypatch.setattr(attention, "_num_sms", lambda device: blocks * step.kv_heads + 1)
    assert not _hopper(_plan(step, canonical=False))
    monkeypatch.setattr(attention, "_num_sms", lambda device: 1)
    monkeypatch.setattr(hopper_prefill, "supports", lambda q, k_cache: False)
    assert not _hopper(_plan(step, canonical=False))
    monkeypatch.setattr(hopper_prefill, "supports", lambda q, k_cache: True)
    monkeypatch.setattr(attention, "HOPPER_PREFILL", False)  # SID_HOPPER_PREFILL unset
    assert not _hopper(_plan(step, canonical=False))


@needs_sm90
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 8, 128), (8, 4, 64), (16, 4, 128), (32, 4, 128)])
def test_hopper_prefill_matches_the_reference(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    """GQA 1/2/4/8, head_dim 64 and 128, cache blocks smaller and larger than a tile: every fast
    row within bf16 noise of the reference, the canonical sequence's rows left poisoned."""
    step = Step(heads, kv_heads, head_dim, block_size, torch.device("cuda"))
    assert hopper_prefill.supports(step.q, step.k_cache)
    out = torch.full_like(step.q, float("nan"))
    hopper_prefill.prefill_attention(step.q, step.k, step.v, step.k_cache, step.v_cache, step.block_tables,
                                     step.seq_lens, step.query_start_loc, step.flags, head_dim**-0.5, out)  # fmt: skip
    fast = step.rows_of([s for s in range(len(SHAPES)) if s != CANONICAL])
    torch.testing.assert_close(out[fast].float(), step.reference()[fast].float(), rtol=2e-2, atol=2e-2)
    assert out[step.rows_of([CANONICAL])].isnan().all()


@needs_sm90
def test_hopper_prefill_serves_sequences_after_others() -> None:
    """A launch over the step's later sequences (``query_start_loc`` past row 0, as beside a
    decode launch) writes their rows alone."""
    step = Step(32, 8, 128, 16, torch.device("cuda"))
    out = torch.full_like(step.q, float("nan"))
    later = slice(2, None)
    hopper_prefill.prefill_attention(
        step.q, step.k, step.v, step.k_cache, step.v_cache, step.block_tables[later], step.seq_lens[later],
        step.query_start_loc[later], torch.zeros_like(step.flags[later]), 128**-0.5, out,
    )  # fmt: skip
    rows = step.rows_of(range(2, len(SHAPES)))
    torch.testing.assert_close(out[rows].float(), step.reference()[rows].float(), rtol=2e-2, atol=2e-2)
    assert out[step.rows_of(range(2))].isnan().all()


@needs_sm90
def test_riding_prompts_keep_their_canonical_bits_beside_the_hopper_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``paged_attention`` with one canonical sequence among fast ones runs both schedules on
    the Hopper kernel, side by side; the fast rows match the reference and the canonical rows
    have the bits of an all-canonical launch of the Triton kernel."""
    step = Step(32, 8, 128, 16, torch.device("cuda"))
    args = (step.q, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, step.query_start_loc, 128**-0.5)
    alone = attention.paged_attention(*args, canonical=True, k=step.k, v=step.v)
    monkeypatch.setattr(attention, "HOPPER_PREFILL", True)
    assert len(_hopper(_plan(step, canonical=step.flags))) == 2
    riding = attention.paged_attention(*args, canonical=step.flags, k=step.k, v=step.v)
    fast = step.rows_of([s for s in range(len(SHAPES)) if s != CANONICAL])
    torch.testing.assert_close(riding[fast].float(), step.reference()[fast].float(), rtol=2e-2, atol=2e-2)
    canonical = step.rows_of([CANONICAL])
    assert torch.equal(riding[canonical], alone[canonical])


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint whose prompt chunks fill an H100's or H200's 132 multiprocessors with
    query blocks: 32 heads, 8 KV heads of 64 dimensions, two layers."""
    from sid.model.builtin import write_checkpoint

    shape = dict(hidden_size=2048, intermediate_size=2048, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=64, max_position_embeddings=4096)  # fmt: skip
    return write_checkpoint(tmp_path_factory.mktemp("wide") / "llama", "LlamaForCausalLM", tokenizer=False, **shape)


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each Hopper launch from now on (``SID_HOPPER_PREFILL=1``): whether it was the canonical
    schedule's."""
    monkeypatch.setattr(attention, "HOPPER_PREFILL", True)
    launches: list[bool] = []
    run = hopper_prefill.prefill_attention

    def counted(*args: object, canonical: hopper_prefill.Canonical | None = None, **kw: object) -> torch.Tensor:
        launches.append(canonical is not None)
        return run(*args, canonical=canonical, **kw)

    monkeypatch.setattr(hopper_prefill, "prefill_attention", counted)
    return launches


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_sm90
def test_the_engine_computes_long_prompts_through_the_hopper_kernel(
    wide_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1,700-token prompt in chunks of 1,024, the second after the first's cached keys: the
    Hopper kernel computes their attention, and every prompt logprob is within bf16 noise of
    transformers' forward pass."""
    from transformers import AutoModelForCausalLM

    from sid import LLM, SamplingParams

    llm = LLM(str(wide_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=1024)
    calls = _count_launches(monkeypatch)
    ids = _prompt(1700, 0)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    layers = 2
    assert calls == [False] * 2 * layers, "both chunks' layers run the Hopper kernel"
    hf = AutoModelForCausalLM.from_pretrained(wide_llama, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].cpu()
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])
    assert (got - want).abs().max() < 0.1


@needs_sm90
def test_a_deterministic_prompt_has_the_same_bits_through_either_kernel(
    wide_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deterministic request's prompt attended by the Triton kernel in chunks of 256 (too few
    query blocks for the Gluon kernel) and by the Gluon kernel in one pass, beside three other
    long prompts: the same tokens and logprobs, bit for bit. Both engines pass the start-up
    self-test, whose passes differ in size too."""
    from sid import LLM, SamplingParams

    det = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2, deterministic=True)
    ids = _prompt(1500, 1)
    results = []
    for chunk in (256, 4096):
        monkeypatch.setattr(attention, "HOPPER_PREFILL", True)  # the self-test's passes too
        llm = LLM(str(wide_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=chunk)
        calls = _count_launches(monkeypatch)
        others = [{"prompt_token_ids": _prompt(1500, 2 + i)} for i in range(3)]
        fast = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        out = llm.generate([*others, {"prompt_token_ids": ids}], [fast] * 3 + [det], use_tqdm=False)[-1]
        results.append((out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs, out.fingerprint))
        assert (True in calls) == (False in calls) == (chunk == 4096), calls
        monkeypatch.undo()
        del llm
    assert results[0] == results[1]


@needs_sm90
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 8, 128), (8, 4, 64), (16, 4, 128), (32, 4, 128)])
def test_hopper_canonical_prefill_has_the_triton_kernels_bits(
    heads: int, kv_heads: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canonical schedule in Gluon gives every canonical row the bits of the Triton
    kernel's canonical launch (whose bits the kernel tests hold across block shapes, batches
    and chunkings), and leaves the fast sequence's rows alone: the condition for the plan to
    run canonical launches on it. Its row sum's wgmma descriptors once had nonzero base offsets:
    rows past key 32 came out wrong and head_dim 64 read an illegal address, which ends the
    process's CUDA context (H100, 2026-12-07), so it runs last in the file."""
    step = Step(heads, kv_heads, head_dim, block_size, torch.device("cuda"))
    flags = 1 - step.flags
    tiling = attention.hopper_canonical(heads // kv_heads)
    assert tiling.row_splits > 0
    out = torch.full_like(step.q, float("nan"))
    hopper_prefill.prefill_attention(step.q, step.k, step.v, step.k_cache, step.v_cache, step.block_tables,
                                     step.seq_lens, step.query_start_loc, flags, head_dim**-0.5, out,
                                     canonical=tiling)  # fmt: skip
    monkeypatch.setattr(attention, "HOPPER_PREFILL", False)
    triton_out = attention.paged_attention(
        step.q, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, step.query_start_loc, head_dim**-0.5,
        canonical=True, k=step.k, v=step.v,
    )  # fmt: skip
    rows = step.rows_of([s for s in range(len(SHAPES)) if s != CANONICAL])
    differ = (out[rows] != triton_out[rows]).any(-1).any(-1)
    assert not differ.any(), f"{int(differ.sum())} of {len(rows)} rows differ, first {rows[differ.cpu()][:5].tolist()}"
    assert out[step.rows_of([CANONICAL])].isnan().all()
