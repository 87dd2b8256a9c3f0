"""The C++ CPU glue kernels against the torch ops they replace.

RoPE and the K/V write must give the same bits as torch; the fused add + RMSNorm keeps the
residual bit-exact and the norm within float32 rounding (its sum of squares runs in another
order); the argmax answers what torch.argmax answers, NaN and ties included.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from external_tools import require_tool

from mstar.engine.model.decoder import RMSNorm
from mstar.engine.model.rope import RotaryEmbedding
from mstar.kernels import cpu_isa, cpu_kernels, write_kv


@pytest.fixture(scope="module", params=[lvl.name for lvl in cpu_isa.supported_levels()])
def kernels(request):
    """Each ISA level's build this CPU runs (the x86-64-v3 one on any AVX2 machine, so the AVX2
    code is checked on AVX-512 machines too); a build failure fails the tests."""
    require_tool("g++")
    require_tool("ninja")
    ext = cpu_kernels.load_level(cpu_isa.resolve(request.param))
    assert ext.isa_level() == request.param
    return ext


def test_the_avx2_level_is_among_those_tested():
    """Every x86-64 machine of this project's kind has AVX2: its build always runs here."""
    if cpu_isa.levels() == cpu_isa.GENERIC_LEVELS:
        pytest.skip("not an x86-64 CPU: one generic build")
    assert "x86-64-v3" in [lvl.name for lvl in cpu_isa.supported_levels()]


def test_the_loader_runs_the_best_level_or_the_one_named(monkeypatch):
    best = cpu_isa.best_level(cpu_isa.detect())
    monkeypatch.delenv(cpu_isa.ENV_LEVEL, raising=False)
    assert cpu_isa.chosen_level() == best
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "avx2")
    if cpu_isa.levels() != cpu_isa.GENERIC_LEVELS:
        assert cpu_isa.chosen_level().name == "x86-64-v3"


def test_a_forced_level_is_the_highest_the_tests_compare(monkeypatch):
    """With MSTAR_CPU_ISA naming x86-64-v3, the kernel tests run the levels an AVX2 CPU has
    (the higher ones would meet oneDNN capped alike); unset, every level this CPU runs."""
    if cpu_isa.levels() == cpu_isa.GENERIC_LEVELS:
        pytest.skip("not an x86-64 CPU")
    monkeypatch.delenv(cpu_isa.ENV_LEVEL, raising=False)
    assert cpu_isa.supported_levels() == cpu_isa.supported_levels(cpu_isa.detect())
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "x86-64-v3")
    assert [lvl.name for lvl in cpu_isa.supported_levels()] == ["x86-64", "x86-64-v3"]


def test_a_level_the_cpu_cannot_run_is_refused_by_name(monkeypatch):
    avx2 = cpu_isa.CpuFeatures(
        frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
    )
    if cpu_isa.levels() == cpu_isa.GENERIC_LEVELS:
        pytest.skip("not an x86-64 CPU")
    assert cpu_isa.best_level(avx2).name == "x86-64-v3"
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "avx512-bf16")
    with pytest.raises(ValueError, match="MSTAR_CPU_ISA='avx512-bf16': this CPU lacks avx512_bf16"):
        cpu_isa.chosen_level(avx2)
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "avx9000")
    with pytest.raises(ValueError, match="names no ISA level here"):
        cpu_isa.chosen_level(avx2)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (130, 100)])
def test_add_rms_norm_matches_torch(kernels, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    summed = residual + x
    expected = F.rms_norm(summed, (hidden,), weight, 1e-6)
    kernels.add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(residual, summed)
    torch.testing.assert_close(x, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (33, 576), (130, 100)])
def test_add_rms_norm_bf16_rounds_where_the_torch_path_rounds(kernels, rows, hidden):
    """bf16: the residual is the bf16 sum, bit-exact; the norm matches HF's bf16 RMSNorm (float32
    statistics, bf16 before the weight) but for a rare one-ulp flip from the float32 sum order."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    norm = RMSNorm(hidden, 1e-6, torch.bfloat16)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).bfloat16()
    summed = residual + x
    expected = norm(summed)
    kernels.add_rms_norm_(x, residual, norm.weight.data, 1e-6)
    assert torch.equal(residual, summed)
    torch.testing.assert_close(x, expected, atol=0, rtol=2**-7)
    assert (x == expected).float().mean() > 0.99


def test_add_rms_norm_refuses_what_it_cannot_do(kernels):
    """A weight in x's dtype, or float32 on bf16 x (Gemma's 1 + w: test_kernels_norms.py)."""
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="weight in x's dtype, or float32 on bfloat16 x"):
        kernels.add_rms_norm_(x, x.clone(), torch.ones(32).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernels.add_rms_norm_(x.double(), x.double(), torch.ones(32).double(), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.add_rms_norm_(x.t(), x.t(), torch.ones(4), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_rope_is_bit_identical_to_the_torch_path(kernels, head_dim, dtype):
    """On a view of fused QKV rows (Q and K heads rotated together), half-widths with and
    without a scalar tail; bf16 rounds each product and sum as torch's bf16 ops do."""
    rope = RotaryEmbedding(head_dim, 512, 10000.0, dtype=dtype)
    tokens, heads = 9, 5
    fused = torch.randn(tokens, (heads + 2) * head_dim).to(dtype)
    qk = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = rope.lookup(torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 64]))
    expected = qk.clone()
    rope.rotate_(expected, cos, sin)
    untouched = fused[:, heads * head_dim :].clone()
    rope.rotate_(qk, cos, sin, kernels=kernels)
    assert torch.equal(qk, expected)
    assert torch.equal(fused[:, heads * head_dim :], untouched)


def test_write_kv_kernel_matches_the_torch_path(kernels, monkeypatch):
    pool = torch.zeros(6, 2, 4, 3, 16)
    fused = torch.randn(5, 9 * 16)
    k = fused[:, 3 * 16 : 6 * 16].view(5, 3, 16)
    v = fused[:, 6 * 16 :].view(5, 3, 16)
    slots = torch.tensor([23, 0, 5, 6, 12])
    write_kv(pool, k, v, slots)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    expected = torch.zeros_like(pool)
    write_kv(expected, k, v, slots)
    assert torch.equal(pool, expected)
    assert int((pool != 0).sum()) == 2 * k.numel()


def test_write_kv_kernel_refuses_a_slot_outside_the_cache(kernels):
    pool = torch.zeros(2, 2, 4, 1, 16)
    k = torch.ones(2, 1, 16)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache's 8 slots"):
        kernels.write_kv(pool, k, k, torch.tensor([1, 8]))
    with pytest.raises(RuntimeError, match="slot -1"):
        kernels.write_kv(pool, k, k, torch.tensor([-1, 0]))
    assert int((pool != 0).sum()) == 0  # checked before any row is copied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch(kernels, dtype):
    """bf16 logits answer as their float32 widening does (the greedy sampler reads them as is)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 1000, generator=gen)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, 999] = 50.0  # in the scalar tail (1000 is not a multiple of 16)
    x[3, :] = float("-inf")
    x[4, 300] = float("nan")  # torch answers the first NaN
    x[4, 20] = float("nan")
    x[5, 5] = float("inf")
    x[6, 998] = float("nan")
    wide = torch.randn(3, 2048, generator=gen).to(dtype)[:, :1000]  # strided rows
    if dtype == torch.bfloat16:
        x[7, 400] = x[7, 401] = 60.0  # bf16 ties: far likelier than in float32
    for batch in (x.to(dtype), wide, torch.randn(2, 7, generator=gen).to(dtype)):
        assert torch.equal(kernels.argmax_rows(batch), batch.float().argmax(dim=1))


def test_argmax_rows_refuses_other_layouts(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.randn(8, 2).t())


@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul_matches_torch(kernels, inter):
    """gate | up halves of the fused projection; the exponential is the kernel's own, so
    within float32 rounding, not bit-equal; large magnitudes saturate like torch's."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(33, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -30.0])
    gate, up = gate_up.split([inter, inter], dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=1e-12, rtol=2e-6)
    with pytest.raises(RuntimeError, match="silu_mul"):
        kernels.silu_mul(gate_up[:, 1:])


def test_silu_mul_bf16_rounds_like_silu_then_mul(kernels):
    """bf16: F.silu(gate) rounds to bf16 before the product; the kernel's exponential can flip
    a rounding now and then, never by more than one bf16 ulp."""
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(33, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gate_up.split([1536, 1536], dim=-1)
    expected = F.silu(gate).mul_(up)
    got = kernels.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0, rtol=2**-7)
    assert (got == expected).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.silu_mul(gate_up.half())


def test_sample_rows_follows_softmax_and_never_draws_filtered_tokens(kernels):
    """Inverse-CDF draws: frequencies match softmax(x) (chi-square, p = 0.001), -inf and NaN
    entries are never drawn, whatever u is, and the row width need not be a multiple of 16."""
    logits = torch.full((1, 37), float("-inf"))
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    cols = torch.tensor([0, 17, 30, 36])  # across a 16-lane chunk boundary and in the tail
    logits[0, cols] = probs.log() + 3.0
    logits[0, 5] = float("nan")
    draws = 20000
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(draws, dtype=torch.float64, generator=gen)
    tokens = kernels.sample_rows(logits.expand(draws, 37).contiguous(), u)
    counts = torch.bincount(tokens, minlength=37)
    assert int(counts[cols].sum()) == draws
    expected = probs * draws
    chi2 = float((((counts[cols] - expected) ** 2) / expected).sum())
    assert chi2 < 16.27, counts[cols].tolist()  # 3 degrees of freedom, p = 0.001
    edges = torch.tensor([0.0, 0.1 - 1e-9, 0.1 + 1e-9, 1.0 - 1e-12], dtype=torch.float64)
    got = kernels.sample_rows(logits.expand(4, 37).contiguous(), edges).tolist()
    assert got == [0, 0, 17, 36]


def test_sample_rows_rows_with_nothing_finite_to_weigh(kernels):
    x = torch.randn(3, 40)
    x[0] = float("-inf")
    x[1, 7] = float("inf")
    u = torch.tensor([0.5, 0.5, 0.999], dtype=torch.float64)
    got = kernels.sample_rows(x, u).tolist()
    assert got[:2] == [0, 7]
    assert 0 <= got[2] < 40
    with pytest.raises(RuntimeError, match="float64"):
        kernels.sample_rows(x, u.float())


def test_write_kv_converts_a_v_of_another_dtype_like_the_torch_path(kernels):
    """k matches the cache and v does not: the copy kernel is skipped, v is converted."""
    pool = torch.zeros(2, 2, 4, 1, 16)
    k = torch.randn(2, 1, 16)
    v = torch.randn(2, 1, 16, dtype=torch.float64)
    write_kv(pool, k, v, torch.tensor([1, 6]))
    assert torch.equal(pool[0, 0, 1], k[0]) and torch.equal(pool[1, 1, 2], v[1].float())


#: the bf16 GEMMs for decode-sized batches: (name prefix, what a level without it lacks)
SMALL_BATCH_GEMMS = {"amx": "no AMX bf16 tiles", "dpbf16": "no AVX512-BF16", "fma": "no FMA"}


def gemm(kernels, kind: str):
    """(linear, pack_weight) of one small-batch GEMM; skips where this CPU lacks it."""
    if not getattr(kernels, f"{kind}_available")():
        pytest.skip(f"the {kernels.isa_level()} build has {SMALL_BATCH_GEMMS[kind]}")
    return getattr(kernels, f"{kind}_linear"), getattr(kernels, f"{kind}_pack_weight")


@pytest.mark.parametrize("kind", list(SMALL_BATCH_GEMMS))
@pytest.mark.parametrize(
    "rows,k,n",
    # tail tiles / passes of rows (1, 15, 17, 33, 130), a K that is no whole AMX tile step (40,
    # zero-padded) or odd (33: VDPBF16PS's last k-pair half empty), columns past a 32-column
    # panel (33, 70)
    [
        (1, 576, 960),
        (15, 64, 32),
        (17, 40, 33),
        (13, 33, 70),
        (33, 576, 576),
        (64, 1536, 64),
        (130, 96, 70),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_rounds_the_float32_product_once(kernels, kind, rows, k, n, with_bias):
    """x @ w.T (+ bias) over AMX tiles, VDPBF16PS or FMA: float32 accumulation of the exact bf16
    products, rounded to bf16 once, for contiguous and strided rows alike."""
    linear, pack = gemm(kernels, kind)
    gen = torch.Generator().manual_seed(rows * k + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    wide = torch.randn(rows, k + 8, generator=gen).to(torch.bfloat16)
    packed = pack(w)
    for x in (wide[:, :k].contiguous(), wide[:, 8:]):
        got = linear(x, packed, n, bias)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        exact = x.double() @ w.double().T
        if bias is not None:
            exact += bias.double()
        torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("kind", list(SMALL_BATCH_GEMMS))
def test_small_batch_linear_refuses_what_it_cannot_do(kernels, kind):
    linear, pack = gemm(kernels, kind)
    packed = pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        linear(x, packed, 33, None)
    # FMA also multiplies float32, but not a float32 x by a bf16 weight
    with pytest.raises(RuntimeError, match="in x's dtype" if kind == "fma" else "x must be bf"):
        linear(x.float(), packed, 32, None)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        linear(torch.zeros(64, 2, dtype=torch.bfloat16).T, packed, 32, None)
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        linear(x, packed, 32, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        linear(x, packed, 32, torch.zeros(32))
    with pytest.raises(RuntimeError, match=f"{kind}_pack_weight"):
        linear(x, packed.flatten(), 32, None)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        pack(torch.zeros(32, 64, dtype=torch.float64 if kind == "fma" else torch.float32))


@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (7, 33, 70), (13, 1536, 64), (70, 96, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fma_linear_multiplies_float32_in_float32(kernels, rows, k, n, with_bias):
    """float32 x @ w.T (+ bias) over float32 panels: within float32 rounding of the exact
    product, for contiguous and strided rows; a row's bits do not depend on the rows beside
    it (the sum over K runs in one fixed order per level)."""
    linear, pack = gemm(kernels, "fma")
    gen = torch.Generator().manual_seed(rows * k + n)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    wide = torch.randn(rows, k + 8, generator=gen)
    packed = pack(w)
    assert packed.dtype == torch.float32
    for x in (wide[:, :k].contiguous(), wide[:, 8:]):
        got = linear(x, packed, n, bias)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        exact = x.double() @ w.double().T
        if bias is not None:
            exact += bias.double()
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
        for r in {0, rows - 1}:
            assert torch.equal(linear(x[r : r + 1], packed, n, bias), got[r : r + 1])
    with pytest.raises(RuntimeError, match="in x's dtype"):
        linear(wide[:, :k].bfloat16(), packed, n, None)


@pytest.mark.parametrize("kind", ["dpbf16", "fma"])
def test_small_batch_linear_takes_no_rows(kernels, kind):
    linear, pack = gemm(kernels, kind)
    got = linear(
        torch.zeros(0, 64, dtype=torch.bfloat16), pack(torch.ones(3, 64).bfloat16()), 3, None
    )
    assert got.shape == (0, 3)


@pytest.mark.parametrize("kind", list(SMALL_BATCH_GEMMS))
def test_small_batch_linear_refuses_a_cpu_without_it(kernels, kind):
    if getattr(kernels, f"{kind}_available")():
        pytest.skip(f"the {kernels.isa_level()} build has {kind}")
    linear = getattr(kernels, f"{kind}_linear")
    packed = getattr(kernels, f"{kind}_pack_weight")(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=SMALL_BATCH_GEMMS[kind]):
        linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 32, None)


def test_a_named_level_caps_what_the_gemms_plan_for(monkeypatch):
    """MSTAR_CPU_ISA=x86-64-v3 on any CPU plans the GEMMs as on an AVX2 one: no oneDNN bf16,
    no bf16 dot products, whatever the machine has."""
    if cpu_isa.levels() == cpu_isa.GENERIC_LEVELS:
        pytest.skip("not an x86-64 CPU")
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, "x86-64-v3")
    features = cpu_isa.planning_features()
    assert cpu_isa.best_level(features).name == "x86-64-v3"
    assert not features.onednn_bf16 and not features.bf16_math
    assert features.vendor == cpu_isa.detect().vendor
    monkeypatch.delenv(cpu_isa.ENV_LEVEL)
    assert cpu_isa.planning_features() == cpu_isa.detect()


def test_the_build_key_is_the_same_in_every_process():
    """Every process (a server, its tests) must find the one shared build: the cache key may
    not depend on hash randomisation."""
    code = (
        "from mstar.kernels import build; print(build.build_dir().relative_to(build.cache_root()))"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    (key,) = keys
    assert [len(part) for part in key.split("/")] == [16, 8]  # source key, compiler key
