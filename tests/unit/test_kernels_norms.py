"""The glue kernels Qwen3's and Gemma 3's layers add to the fused decode, against the torch
ops they replace: RMSNorm over each head of fused QKV rows (q/k norm) and over whole rows
(Gemma's post-attention / post-feed-forward norms), Gemma's ``1 + w`` weight held in float32
on bf16 rows, and GELU-tanh(gate) * up. Each within float32 rounding of torch (a sum of squares
or a tanh in another order), bf16 at most a rare one-ulp flip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels_cpu import kernels  # noqa: F401  (the fixture: every level this CPU runs)

from mstar.engine.model.layers import RMSNorm

#: (x dtype, Gemma's 1 + w): the conventions `RMSNorm` has
CONVENTIONS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]


def _norm(dim: int, dtype: torch.dtype, offset: bool, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, dtype, offset=offset).requires_grad_(False)
    norm.load_(torch.rand(dim, generator=gen) - (0.5 if offset else -0.5))
    return norm


def _assert_close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    """float32 within rounding; bf16 one ulp, rarely. ``atol``: where torch's own value is
    off by more (GELU-tanh's 1 + tanh(y) cancelling far below 0: there only values of at
    least 1e-2 count for bf16's equal share)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5)
        return
    torch.testing.assert_close(got, expected, atol=atol if atol > 1e-6 else 0, rtol=2**-7)
    counted = expected.abs() >= (1e-2 if atol > 1e-6 else 0)
    assert (got == expected)[counted].float().mean() > 0.99


@pytest.mark.parametrize(("dtype", "offset"), CONVENTIONS)
@pytest.mark.parametrize("head_dim", [32, 128, 256])
@torch.no_grad()
def test_rms_norm_over_heads_of_fused_qkv_rows(kernels, dtype, offset, head_dim):  # noqa: F811
    """Q heads of a [T, Q + K + V] row normed in place; K and V untouched."""
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, rows = 4, 2, 9
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    view = qkv.view(rows, heads + 2 * kv_heads, head_dim)
    norm = _norm(head_dim, dtype, offset, gen)
    before = qkv.clone()
    expected = norm(view[:, :heads])
    kernels.rms_norm_(view[:, :heads], norm.weight, 1e-6)
    _assert_close(view[:, :heads], expected)
    assert torch.equal(qkv[:, heads * head_dim :], before[:, heads * head_dim :])


@pytest.mark.parametrize(("dtype", "offset"), CONVENTIONS)
@pytest.mark.parametrize("hidden", [640, 100])
@torch.no_grad()
def test_rms_norm_of_rows_and_the_added_one(kernels, dtype, offset, hidden):  # noqa: F811
    """Whole rows (a sandwich norm), and the residual add + norm with the same weight."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 2).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype)
    norm = _norm(hidden, dtype, offset, gen)
    expected = norm(x)
    got = x.clone()
    kernels.rms_norm_(got, norm.weight, 1e-6)
    _assert_close(got, expected)
    summed = residual + x
    kernels.add_rms_norm_(x, residual, norm.weight, 1e-6)
    assert torch.equal(residual, summed)
    _assert_close(x, norm(summed))


def test_rms_norm_refuses_what_it_cannot_do(kernels):  # noqa: F811
    x = torch.randn(4, 3, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm_(x.transpose(1, 2), torch.ones(3), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        kernels.rms_norm_(x, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="float32 on bfloat16 x"):
        kernels.rms_norm_(x, torch.ones(32).bfloat16(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [2048, 40])
def test_gelu_tanh_mul_matches_torch(kernels, dtype, inter):  # noqa: F811
    """F.gelu(gate, approximate="tanh").mul_(up), large magnitudes saturating like torch's;
    float32 within 1e-5 where torch's 1 + tanh(y) cancels (gate far below 0: |gate * up| of
    ~50 times float32's epsilon)."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(33, 2 * inter, generator=gen) * 4
    gate_up[0, :5] = torch.tensor([-120.0, 120.0, 0.0, -30.0, 1e-4])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split([inter, inter], dim=-1)
    expected = F.gelu(gate, approximate="tanh").mul_(up)
    got = kernels.gelu_tanh_mul(gate_up)
    assert got.dtype == dtype
    _assert_close(got, expected, atol=1e-5)
    with pytest.raises(RuntimeError, match="gelu_tanh_mul"):
        kernels.gelu_tanh_mul(gate_up[:, 1:])
