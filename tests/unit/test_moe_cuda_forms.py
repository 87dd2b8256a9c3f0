"""The fixed-shape expert forms a CUDA graph records when torch's grouped GEMM cannot run
(`model.moe_cuda`; issue 45), on CPU: float32 equal to `grouped_experts` (the block's torch
path) within 1e-5 with the same argmax, for Qwen3-MoE's SiLU experts and gpt-oss's clamped
SwiGLU ones with biases, at decode and prompt row counts, with experts that receive no token
and one that receives every token; and, on meta tensors (which cannot be read back), the router
and every fixed form make no host read while the per-expert loop does.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import EXPERTS, TOP_K, _routing

from mstar.engine.model import moe_cuda
from mstar.engine.model.moe import MoeBlock, MoeSpec, route
from mstar.engine.model.moe_cuda import (
    Experts,
    dense_experts,
    fixed_shape_experts,
    gathered_experts,
    grouped_mm_runs,
)
from mstar.kernels.moe_experts import grouped_experts

HIDDEN, INTER = 48, 24
FORMS = [gathered_experts, dense_experts, fixed_shape_experts]


def _spec(model_type: str) -> MoeSpec:
    return MoeSpec.from_config(
        {"model_type": model_type, "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
         "intermediate_size": INTER, "num_experts": EXPERTS, "num_local_experts": EXPERTS,
         "num_experts_per_tok": TOP_K, "swiglu_limit": 1.5}
    )  # fmt: skip


def _experts(model_type: str, device: str = "cpu") -> Experts:
    """A block's experts, random (scaled per fan-in) where the device holds values."""
    block = MoeBlock(_spec(model_type), device=device)
    if device != "meta":
        gen = torch.Generator().manual_seed(5)
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 2 * p.shape[-1] ** -0.5)
    return Experts(block.gate_up, block.gate_up_bias, block.down, block.down_bias, block.spec.act)


@pytest.mark.parametrize("routing", ["spread", "idle", "all"])
@pytest.mark.parametrize("tokens", [1, 4, 37])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_fixed_forms_equal_the_grouped_path(routing: str, tokens: int, model_type: str) -> None:
    gen = torch.Generator().manual_seed(tokens)
    e = _experts(model_type)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = _routing(routing, tokens, gen)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
    want = grouped_experts(
        x, ids, weights, e.gate_up, e.gate_up_bias, e.down, e.down_bias, e.act, grouped_mm=False
    )
    for form in FORMS:
        got = form(x, ids, weights, e)
        assert got.dtype == x.dtype and got.shape == (tokens, HIDDEN)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=form.__name__)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), form.__name__


def test_fixed_shape_picks_the_gather_for_few_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to EXPERTS (token, choice) rows the gather reads fewer weights; past it, the dense
    form reads each expert once."""
    e = _experts("qwen3_moe")
    ran: list[str] = []
    for form in (gathered_experts, dense_experts):
        monkeypatch.setattr(moe_cuda, form.__name__, lambda *a, f=form: ran.append(f.__name__))
    for tokens in (EXPERTS // TOP_K, EXPERTS // TOP_K + 1):
        ids = _routing("spread", tokens, torch.Generator().manual_seed(1))
        fixed_shape_experts(torch.randn(tokens, HIDDEN), ids, torch.full((tokens, TOP_K), 0.5), e)
    assert ran == ["gathered_experts", "dense_experts"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_router_and_fixed_forms_make_no_host_read(model_type: str) -> None:
    """Meta tensors hold no values: ``.tolist()``/``.item()`` on one raises, so a function that
    runs on them end to end reads nothing back (as a graph capture requires)."""
    spec = _spec(model_type)
    e = _experts(model_type, device="meta")
    for tokens in (1, 16):
        x = torch.empty(tokens, HIDDEN, device="meta")
        weights, ids = route(torch.empty(tokens, EXPERTS, device="meta"), spec)
        for form in FORMS:
            out = form(x, ids, weights, e)
            assert out.shape == (tokens, HIDDEN) and out.device.type == "meta"
        with pytest.raises((NotImplementedError, RuntimeError)):  # the loop reads counts
            grouped_experts(
                x, ids, weights, e.gate_up, e.gate_up_bias, e.down, e.down_bias, e.act,
                grouped_mm=False,
            )  # fmt: skip
    assert not grouped_mm_runs(torch.empty(1, HIDDEN, dtype=torch.bfloat16))  # a CPU tensor
