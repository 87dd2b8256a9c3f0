"""The C++ grouped expert kernel (``moe_experts``) at every ISA level this CPU runs, against a
torch reference that rounds where the kernel rounds: float32 and bf16, every packed layout the
level has (FMA panels everywhere; VDPBF16PS panels on AVX512-BF16; AMX tiles on AMX), both
activations, with and without biases, shapes with partial panels, and routings where some
experts receive no token and one receives every token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import level_kernels

from mstar.kernels import cpu_isa
from mstar.kernels.moe_experts import CpuExperts, ExpertAct, ExpertActivation, grouped_experts

HIDDEN, INTER, EXPERTS, TOP_K = 72, 40, 6, 2  # neither a whole number of 16- or 32-wide panels
SWIGLU = ExpertAct(ExpertActivation.CLAMPED_SWIGLU, alpha=1.702, limit=7.0)


def _layouts() -> list[tuple[str, torch.dtype, str]]:
    """(level, dtype, layout) for every level this CPU runs and every layout that level has."""
    cases = []
    for level in cpu_isa.supported_levels():
        cases += [(level.name, torch.float32, "fma"), (level.name, torch.bfloat16, "fma")]
        if "avx512_bf16" in level.requires:
            cases.append((level.name, torch.bfloat16, "dpbf16"))
        if "amx_tile" in level.requires:
            cases.append((level.name, torch.bfloat16, "amx"))
    return cases


def _routing(kind: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """ids [T, k]: distinct experts per token; ``idle``: only experts 1 and 4 receive tokens;
    ``all``: expert 3 is every token's first choice."""
    if kind == "idle":
        pair = torch.tensor([1, 4])
        flip = torch.randint(0, 2, (tokens, 1), generator=gen).bool()
        return torch.where(flip, pair.flip(0), pair).expand(tokens, 2).contiguous()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    if kind == "all":
        others = torch.tensor([e for e in range(EXPERTS) if e != 3])
        ids[:, 0] = 3
        ids[:, 1] = others[torch.randint(0, len(others), (tokens,), generator=gen)]
    return ids


def _reference(x, ids, weights, gate_up, gate_up_bias, down, down_bias, act) -> torch.Tensor:
    """Expert by expert in float32, rounded to x's dtype where the kernel rounds: after each
    projection and in the activation, the token's choices summed in float32 and rounded once."""
    dtype = x.dtype
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            b1 = None if gate_up_bias is None else gate_up_bias[e].float()
            b2 = None if down_bias is None else down_bias[e].float()
            h = F.linear(x[t : t + 1].float(), gate_up[e].float(), b1).to(dtype).float()
            if act.kind == ExpertActivation.SILU_MUL:  # SiLU rounded, then the product
                gate, up = h[:, :INTER], h[:, INTER:]
                a = (F.silu(gate).to(dtype).float() * up).to(dtype).float()
            else:  # computed in float32, rounded once
                a = act(h).to(dtype).float()
            y = F.linear(a, down[e].float(), b2).to(dtype).float()
            out[t] += weights[t, j] * y[0]
    return out.to(dtype)


def _weights(dtype: torch.dtype, bias: bool, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    gate_up = rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5 * 2)
    down = rand(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
    if not bias:
        return gate_up, None, down, None
    return gate_up, rand(EXPERTS, 2 * INTER, scale=0.5), down, rand(EXPERTS, HIDDEN, scale=0.5)


@pytest.mark.parametrize("routing", ["spread", "idle", "all"])
@pytest.mark.parametrize("tokens", [1, 13, 150])
@pytest.mark.parametrize(("level", "dtype", "layout"), _layouts())
def test_grouped_experts_match_torch(level, dtype, layout, tokens, routing) -> None:
    kernels = level_kernels(level)
    pack = {"fma": kernels.fma_pack_weight, "dpbf16": kernels.dpbf16_pack_weight}.get(
        layout, kernels.amx_pack_weight
    )
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = _routing(routing, tokens, gen)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
    for act, bias in ((ExpertAct(), False), (SWIGLU, True)):
        gate_up, gate_up_bias, down, down_bias = _weights(dtype, bias, gen)
        experts = CpuExperts.pack(kernels, gate_up, gate_up_bias, down, down_bias, act, pack)
        got = experts(x, ids, weights)
        expected = _reference(x, ids, weights, gate_up, gate_up_bias, down, down_bias, act)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:  # a GEMM's float32 sum order can flip a bf16 rounding, which then propagates
            torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
            assert (got == expected).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bits_do_not_depend_on_the_thread_count(dtype) -> None:
    """Each token's choices are summed in choice order, and each expert's rows go through one
    GEMM whatever thread runs it: 1 and 2 threads give the same bits."""
    kernels = level_kernels(cpu_isa.supported_levels()[-1].name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, HIDDEN, generator=gen).to(dtype)
    ids = _routing("all", 64, gen)
    weights = torch.rand(64, TOP_K, generator=gen)
    experts = CpuExperts.pack(kernels, *_weights(dtype, True, gen), SWIGLU)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = experts(x, ids, weights)
        torch.set_num_threads(2)
        two = experts(x, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_the_torch_paths_match_the_kernel(grouped_mm: bool) -> None:
    """torch's grouped GEMM (CUDA's path, run here on CPU) and the per-expert ``mm`` loop (CPU
    without the kernels) on the same float32 weights, idle experts and a hot one included."""
    kernels = level_kernels(cpu_isa.supported_levels()[-1].name)
    gen = torch.Generator().manual_seed(1)
    for routing in ("spread", "idle", "all"):
        x = torch.randn(37, HIDDEN, generator=gen)
        ids = _routing(routing, 37, gen)
        weights = torch.rand(37, TOP_K, generator=gen)
        stacks = _weights(torch.float32, True, gen)
        got = grouped_experts(x, ids, weights, *stacks, SWIGLU, grouped_mm=grouped_mm)
        expected = CpuExperts.pack(kernels, *stacks, SWIGLU)(x, ids, weights)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_by_name() -> None:
    kernels = level_kernels(cpu_isa.supported_levels()[-1].name)
    gen = torch.Generator().manual_seed(2)
    experts = CpuExperts.pack(kernels, *_weights(torch.float32, False, gen), ExpertAct())
    x = torch.randn(3, HIDDEN)
    weights = torch.ones(3, TOP_K)
    with pytest.raises(RuntimeError, match="expert id 6 is outside"):
        experts(x, torch.tensor([[0, 1], [2, 6], [3, 4]]), weights)
    with pytest.raises(RuntimeError, match="packed weights must be in x's dtype"):
        experts(x.bfloat16(), torch.zeros(3, TOP_K, dtype=torch.long), weights)
    with pytest.raises(RuntimeError, match="topk_ids must be a contiguous int64"):
        experts(x, torch.zeros(3, TOP_K, dtype=torch.int32), weights)
