"""Triton row-wise kernels (RMSNorm, rotary, SwiGLU, rotary fused with the q/k norm and the KV
store) against their torch references
(``sid.kernels.layers_ref``, which the model runs off CUDA and tests/test_models.py checks
against transformers).

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py), so sizes are
small. Inputs are views inside NaN-filled buffers and outputs start as NaN, so a kernel that
reads past a row, writes outside its rows or leaves an element unwritten fails; q/k are
strided views of one merged qkv tensor, as in ``sid.model.decoder``.

Triton 3.6's interpreter truncates float32 -> bfloat16 casts, where compiled Triton rounds
to nearest even as torch does; ``_round_bf16_to_nearest_even`` makes it round, so the
interpreter checks the compiled kernels' rounding (the residual sum must be bit-exact).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from triton import knobs

from sid.kernels.activation import silu_and_mul
from sid.kernels.attention_ref import store_kv_ref
from sid.kernels.layers_ref import apply_rotary_ref, rms_norm_ref, silu_and_mul_ref
from sid.kernels.rms_norm import rms_norm
from sid.kernels.rotary import apply_rotary, rope_and_store
from sid.model.config import RopeConfig
from sid.model.layers import QKRope, RMSNorm, RotaryEmbedding
from sid.runtime.attention import TorchAttentionBackend
from sid.runtime.triton_backend import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""float32 differs from torch only by reduction order / exp rounding; bf16 by about one ulp."""
MAX_BF16_FLIPS = 0.01
"""Share of bf16 elements that may differ from the reference bits at all. Rounding at the
reference's points leaves all but the rare float32 intermediate within an ulp of a rounding
boundary identical; a missed or extra rounding step changes about a quarter of them."""
EPS = 1e-6


@pytest.fixture(autouse=True)
def _round_bf16_to_nearest_even(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, cast float32 to bfloat16 with torch's (and compiled Triton's) rounding."""
    if not knobs.runtime.interpret:
        return
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(
        self: interpreter.InterpreterBuilder, src: interpreter.TensorHandle, dst_type: tl.dtype
    ) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    tol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
    if actual.dtype == torch.bfloat16:
        assert (actual != expected).float().mean() <= MAX_BF16_FLIPS


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _padded(t: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` copied into the leading columns of a NaN buffer ``pad`` columns wider: (buffer, view)."""
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype, device=t.device)
    view = buffer[..., : t.shape[-1]]
    view.copy_(t)
    return buffer, view


def _split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v exactly as the decoder makes them: ``.split`` of one qkv output, then ``.view``."""
    n, q_size, kv_size = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


def _qkv(
    n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """A random merged qkv output and its q, k, v views."""
    qkv = _randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen, scale=3.0)
    return qkv, *_split_qkv(qkv, heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(7, 96), (5, 80), (2, 4096)])
@pytest.mark.parametrize("fused_add", [False, True])
def test_rms_norm_rows(dtype: torch.dtype, rows: int, dim: int, fused_add: bool) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    # x and residual sit inside NaN buffers: a read past D poisons the row.
    _, x = _padded(_randn(rows, dim, dtype=dtype, gen=gen, scale=2.0), 3)
    weight = _randn(dim, dtype=dtype, gen=gen) + 1
    out_buffer = torch.full((rows + 2, dim), float("nan"), dtype=dtype, device=DEVICE)
    out = out_buffer[1:-1]
    if not fused_add:
        got = rms_norm(x, weight, EPS, out=out)
        assert got is out
        _close(out, rms_norm_ref(x, weight, EPS))
    else:
        res_buffer, residual = _padded(_randn(rows, dim, dtype=dtype, gen=gen), 5)
        want_res = residual.clone()
        want = rms_norm_ref(x, weight, EPS, residual=want_res)[0]
        got, got_res = rms_norm(x, weight, EPS, residual=residual, out=out)
        assert got is out and got_res is residual
        # The sum is rounded once, to the dtype: bit-identical to torch's ``x + residual``.
        assert torch.equal(residual, want_res)
        assert res_buffer[:, dim:].isnan().all()
        _close(out, want)
    assert not out.isnan().any()
    assert out_buffer[0].isnan().all() and out_buffer[-1].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 128), (2, 2, 80)])
def test_rms_norm_heads_of_strided_qk(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Qwen3's per-head q/k norm on non-contiguous views of the qkv output; ``out=x`` works in place."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    n = 5
    _, q, k, v = _qkv(n, heads, kv_heads, head_dim, dtype, gen)
    assert not q.is_contiguous() and not k.is_contiguous()
    q_weight = _randn(head_dim, dtype=dtype, gen=gen) + 1
    k_weight = _randn(head_dim, dtype=dtype, gen=gen) + 1
    q_want, k_want = rms_norm_ref(q, q_weight, EPS), rms_norm_ref(k, k_weight, EPS)
    q_before, v_before = q.clone(), v.clone()
    # Into a NaN buffer whose head stride differs from q's; padding columns stay NaN.
    out_buffer, out = _padded(torch.full_like(q, float("nan")), 3)
    assert rms_norm(q, q_weight, EPS, out=out) is out
    assert not out.isnan().any() and out_buffer[..., head_dim:].isnan().all()
    _close(out, q_want)
    assert torch.equal(rms_norm(q, q_weight, EPS), out)
    assert torch.equal(q, q_before)
    assert rms_norm(k, k_weight, EPS, out=k) is k
    _close(k, k_want)
    assert torch.equal(v, v_before)


def _tables(
    max_positions: int, head_dim: int, used: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cos/sin tables (halves differ, so each half must use its own entries); rows
    that no token uses are NaN."""
    cos = torch.rand(max_positions, head_dim, generator=gen) * 2 - 1
    sin = torch.rand(max_positions, head_dim, generator=gen) * 2 - 1
    unused = torch.ones(max_positions, dtype=torch.bool)
    unused[used] = False
    cos[unused] = float("nan")
    sin[unused] = float("nan")
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 128), (2, 2, 80), (8, 2, 96)])
def test_rotary_in_place_on_strided_qk(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 7 + head_dim)
    n, max_positions = 6, 40
    positions = torch.randperm(max_positions, generator=gen)[:n]
    cos, sin = _tables(max_positions, head_dim, positions, gen)
    positions = positions.to(DEVICE)
    qkv, q, k, _ = _qkv(n, heads, kv_heads, head_dim, dtype, gen)
    want = qkv.clone()
    q_want, k_want, _ = _split_qkv(want, heads, kv_heads, head_dim)
    apply_rotary_ref(q_want, k_want, cos, sin, positions)
    assert not torch.equal(want, qkv)
    apply_rotary(q, k, cos, sin, positions)
    assert not qkv.isnan().any()
    _close(q, q_want)
    _close(k, k_want)
    # v shares the buffer and must be left alone.
    assert torch.equal(qkv[:, -kv_heads * head_dim :], want[:, -kv_heads * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 128), (2, 2, 80)])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_store_is_norm_rotary_and_store_in_one(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, norm: bool
) -> None:
    """The fused launch against the references one after another: q and k normed (Qwen3) and
    rotated in place, the rotated keys and the values in their slots, every other slot and v
    itself untouched; a token with slot -1 is rotated but stored nowhere."""
    gen = torch.Generator().manual_seed(heads * 11 + head_dim + norm)
    n, max_positions, num_blocks, block_size = 7, 40, 6, 4
    positions = torch.randperm(max_positions, generator=gen)[:n]
    cos, sin = _tables(max_positions, head_dim, positions, gen)
    positions = positions.to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[3] = -1
    slots = slots.to(DEVICE)
    qkv, q, k, v = _qkv(n, heads, kv_heads, head_dim, dtype, gen)
    weights = (_randn(head_dim, dtype=dtype, gen=gen) + 1, _randn(head_dim, dtype=dtype, gen=gen) + 1)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    want, k_want, v_want = qkv.clone(), k_cache.clone(), v_cache.clone()
    q_want, kk_want, vv_want = _split_qkv(want, heads, kv_heads, head_dim)
    if norm:
        q_want.copy_(rms_norm_ref(q_want, weights[0], EPS))
        kk_want.copy_(rms_norm_ref(kk_want, weights[1], EPS))
    apply_rotary_ref(q_want, kk_want, cos, sin, positions)
    store_kv_ref(kk_want, vv_want, k_want, v_want, slots)
    rope_and_store(q, k, v, cos, sin, positions, k_cache, v_cache, slots, (*weights, EPS) if norm else None)
    assert not qkv.isnan().any()
    _close(q, q_want)
    _close(k, kk_want)
    assert torch.equal(v, vv_want)
    stored = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    stored[slots[slots >= 0]] = True
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, kv_heads, head_dim)
        assert flat[~stored].isnan().all() and not flat[stored].isnan().any()
    # The cache holds exactly the kernel's own rotated keys (what a prompt's attention reads from k).
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]], k[slots.cpu() >= 0])
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[stored], v_want.view(-1, kv_heads, head_dim)[stored])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_triton_backend_applies_a_layers_qkrope_as_the_torch_one_does(qk_norm: bool) -> None:
    """The attention hook's first step, through both backends: the Triton one hands the
    layer's ``QKRope`` (its rotary table, positions and Qwen3's norms) to the fused launch and
    must leave q, k and the cache as the torch one's steps in sequence do (in inference mode,
    as the engine runs them)."""
    gen = torch.Generator().manual_seed(int(qk_norm))
    n, heads, kv_heads, head_dim, max_positions = 6, 4, 2, 64, 64
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, max_positions).to(DEVICE)
    norms = [RMSNorm(head_dim, EPS).to(DEVICE) for _ in range(2)] if qk_norm else [None, None]
    for norm in norms:
        if norm is not None:
            norm.weight.data = _randn(head_dim, dtype=torch.float32, gen=gen) + 1
    rope = QKRope(torch.randperm(max_positions, generator=gen)[:n].to(DEVICE), rotary, *norms)
    slots = torch.randperm(16, generator=gen)[:n].to(DEVICE)
    qkv = _qkv(n, heads, kv_heads, head_dim, torch.float32, gen)[0]
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        out = qkv.clone()
        q, k, v = _split_qkv(out, heads, kv_heads, head_dim)
        caches = [torch.full((4, 4, kv_heads, head_dim), float("nan"), device=DEVICE) for _ in range(2)]
        with torch.inference_mode():
            backend.rope_and_store(q, k, v, rope, *caches, slots)
        results.append((out, *caches))
    (want, k_want, v_want), (got, k_got, v_got) = results
    assert not torch.equal(want, qkv)
    _close(got, want)
    assert torch.equal(k_got.isnan(), k_want.isnan()) and torch.equal(v_got.isnan(), v_want.isnan())
    _close(k_got.nan_to_num(0.0), k_want.nan_to_num(0.0))
    assert torch.equal(v_got.nan_to_num(0.0), v_want.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(5, 96), (3, 80), (2, 1300)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    """``gate_up`` and ``out`` are column slices of wider buffers; 1300 spans two column blocks."""
    gen = torch.Generator().manual_seed(rows + inter)
    _, gate_up = _padded(_randn(rows, 2 * inter, dtype=dtype, gen=gen, scale=4.0), 3)
    out_buffer = torch.full((rows, inter + 2), float("nan"), dtype=dtype, device=DEVICE)
    out = out_buffer[:, 1:-1]
    assert silu_and_mul(gate_up, out=out) is out
    assert not out.isnan().any()
    assert out_buffer[:, 0].isnan().all() and out_buffer[:, -1].isnan().all()
    _close(out, silu_and_mul_ref(gate_up))
    _close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


def test_empty_batches() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), EPS).shape == (0, 64)
    q, k = torch.empty(0, 4, 64, device=DEVICE), torch.empty(0, 2, 64, device=DEVICE)
    table = torch.ones(8, 64, device=DEVICE)
    apply_rotary(q, k, table, table, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
