"""Which GEMM a CPU linear layer runs (`mstar.kernels.cpu_gemm`), on tiny checkpoints: oneDNN's
packed kernels, the small-batch bf16 kernels (AMX, VDPBF16PS, FMA), float32 copies where the CPU
has no bf16 math, and the choice an AVX2 CPU gets, its features substituted for this machine's.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from external_tools import require_tool
from mstar_model_testutil import PagedPool
from tiny_checkpoints import VOCAB, hf_logits, make_checkpoint

from mstar.engine.model import load_model, loader
from mstar.kernels import cpu_isa, cpu_kernels
from mstar.kernels.cpu_gemm import (
    AMX_MAX_ROWS,
    AMX_PROMPT_MAX_K,
    AMX_PROMPT_MAX_N,
    AMX_PROMPT_MAX_ROWS,
    BF16_FLOAT32_GEMM_MIN_ROWS,
    DPBF16_MAX_ROWS,
    FLOAT32_FMA_MAX_ROWS,
    FMA_MAX_ROWS,
    FMA_MAX_ROWS_AVX512,
    INTEL_FLOAT32_PACKED_MIN_ROWS,
    PackedLinear,
    float32_packed_min_rows,
    small_batch_kernel,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: for tests of oneDNN's own bf16 GEMM, which an AVX2 CPU (or ``MSTAR_CPU_ISA`` forcing that
#: level, with oneDNN capped alike) does not have: torch raises on a bf16 weight there
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_isa.planning_features().onednn_bf16,
    reason="oneDNN has no bf16 GEMM on this CPU (or at the level MSTAR_CPU_ISA forces)",
)


@pytest.mark.parametrize("native_bf16", [pytest.param(True, marks=needs_onednn_bf16), False])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: QKV bias through the packed path
def test_bfloat16_load_close_to_transformers(tmp_path, monkeypatch, family, native_bf16):
    """Both bf16 GEMM routes (oneDNN's bf16 kernel, float32 GEMMs on CPUs without bf16 math)."""
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: native_bf16)
    hf = make_checkpoint(tmp_path, family)
    decoder, cfg, _ = load_model(tmp_path, "bfloat16")
    assert decoder.dtype == torch.bfloat16
    # On CPU every bf16 projection and the LM head run on oneDNN-prepacked weights.
    qkv = decoder.layers[0].qkv_proj
    assert isinstance(qkv, PackedLinear) and isinstance(decoder.lm_head, PackedLinear)
    assert qkv.upcast is (not native_bf16) and decoder.lm_head.upcast is (not native_bf16)
    ids = random.Random(4).choices(range(VOCAB), k=20)
    pool = PagedPool(cfg, num_pages=16, page_size=4, dtype=torch.bfloat16)
    ours = pool.step(decoder, [(0, ids)], all_logits=True)
    assert ours.shape[0] == len(ids)
    hf_bf16 = hf.to(torch.bfloat16)
    torch.testing.assert_close(ours, hf_logits(hf_bf16, ids), atol=0.1, rtol=0.05)


def _kernel_layers(folder, dtype: str) -> tuple[Any, list[PackedLinear]]:
    """The kernels a tiny Qwen2 (QKV bias) loads with in ``dtype``, and three of its packed
    layers: the LM head, a QKV and a down projection."""
    require_tool("g++")
    require_tool("ninja")
    make_checkpoint(folder, "qwen2")
    decoder, _, _ = load_model(folder, dtype)
    kernels = decoder.cpu_kernels
    assert kernels is not None
    layers = [decoder.lm_head, *(getattr(decoder.layers[0], n) for n in ("qkv_proj", "down_proj"))]
    assert all(isinstance(layer, PackedLinear) for layer in layers)
    return kernels, layers  # type: ignore[return-value]


def test_bf16_decode_sized_batches_take_the_small_batch_kernel(tmp_path):
    """Where the CPU has AMX tiles or AVX512-BF16, every bf16 projection keeps that kernel's
    packed weight too, and batches up to its row limit run it (bias included); larger ones
    oneDNN's kernel. On AMX a small model's projections take the tiles for prompt chunks too
    (`AMX_PROMPT_MAX_ROWS`; a large model's layers and LM head only decode-sized batches).
    Elsewhere no layer holds a second copy."""
    kernels, layers = _kernel_layers(tmp_path, "bfloat16")
    kernel = small_batch_kernel(kernels)
    if kernel is None:
        assert all(layer.small_batch_weight is None for layer in layers)
        return
    linear, _, max_rows = kernel
    if kernels.amx_available():
        assert (max_rows, linear) == (AMX_MAX_ROWS, kernels.amx_linear)
    elif kernels.dpbf16_available():
        assert (max_rows, linear) == (DPBF16_MAX_ROWS, kernels.dpbf16_linear)
    else:
        avx512 = "avx512f" in cpu_isa.planning_features().flags
        want_rows = FMA_MAX_ROWS_AVX512 if avx512 else FMA_MAX_ROWS
        assert (max_rows, linear) == (want_rows, kernels.fma_linear)
    gen = torch.Generator().manual_seed(3)
    for layer in layers:
        assert layer.small_batch_weight is not None
        small = layer.out_features <= AMX_PROMPT_MAX_N and layer.in_features <= AMX_PROMPT_MAX_K
        max_rows = AMX_PROMPT_MAX_ROWS if kernels.amx_available() and small else kernel[2]
        assert layer.small_batch_max_rows == max_rows
        for rows in (1, 17, max_rows, max_rows + 1):
            x = torch.randn(rows, layer.in_features, generator=gen).to(torch.bfloat16)
            if rows <= max_rows:
                want = linear(x, layer.small_batch_weight, layer.out_features, layer.bias)
            else:
                want = torch.ops.mkldnn._linear_pointwise(
                    x.float() if layer.upcast else x,
                    layer.packed_weight,
                    layer.float32_bias if layer.upcast else layer.bias,
                    "none",
                    [],
                    "",
                ).to(x.dtype)
            assert torch.equal(layer(x), want)


#: /proc/cpuinfo flags of a 2-core AMD EPYC of family 23 (Zen 1): AVX2, FMA, F16C, no AVX-512
ZEN1_CPUINFO = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe abm adx sha_ni "
    "xsave xsaveopt aes pclmulqdq rdrand rdseed clflushopt"
)
ZEN1_FLAGS = frozenset(ZEN1_CPUINFO.split())
#: a Skylake-SP / Cascade Lake Xeon: AVX-512 without bf16 math (oneDNN emulates bf16 there)
SKYLAKE_FLAGS = ZEN1_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("flags", "vendor", "level", "max_rows"),
    [
        (ZEN1_FLAGS, "AuthenticAMD", "x86-64-v3", FMA_MAX_ROWS),
        (SKYLAKE_FLAGS, "GenuineIntel", "x86-64-v4", FMA_MAX_ROWS_AVX512),
    ],
    ids=["avx2", "avx512-no-bf16"],
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_without_bf16_math_never_runs_onednn_bf16(
    tmp_path, monkeypatch, family, flags, vendor, level, max_rows
):
    """A CPU without bf16 math (its features substituted, the kernels' build for it): on AVX2
    oneDNN has no bf16 GEMM and raises on a bf16 weight, on AVX-512 it emulates one 2-3x slower
    than its float32 kernel. So bf16 layers keep the FMA kernel for decode-sized batches and
    float32 copies for the rest, and the model stays close to transformers in bf16."""
    require_tool("g++")
    require_tool("ninja")
    cpu = cpu_isa.CpuFeatures(frozenset(flags), vendor)
    assert cpu_isa.best_level(cpu).name == level and not cpu.bf16_math
    if not cpu_isa.detect().runs(cpu_isa.resolve(level)):
        pytest.skip(f"this CPU cannot run the {level} build")
    monkeypatch.setattr(cpu_isa, "detect", lambda: cpu)
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, level)
    cpu_kernels.load.cache_clear()
    try:
        hf = make_checkpoint(tmp_path, family)
        decoder, cfg, _ = load_model(tmp_path, "bfloat16")
    finally:
        cpu_kernels.load.cache_clear()
    kernels = decoder.cpu_kernels
    assert kernels is not None and kernels.isa_level() == level
    for layer in (decoder.lm_head, decoder.layers[0].qkv_proj, decoder.layers[1].down_proj):
        assert isinstance(layer, PackedLinear) and layer.upcast
        assert layer.few_rows_weight is None and layer.packed_weight.dtype == torch.float32
        assert layer.small_batch_linear == kernels.fma_linear
        assert layer.small_batch_max_rows == max_rows
    # Three prompts in one step: more rows than max_rows (float32 GEMMs), then one decode row
    # each (the FMA kernel).
    seqs = [random.Random(4 + s).choices(range(VOCAB), k=max_rows // 3 + 4) for s in range(3)]
    pool = PagedPool(cfg, num_pages=48, page_size=4, dtype=torch.bfloat16)
    prompt = pool.step(decoder, [(s, ids[:-1]) for s, ids in enumerate(seqs)], all_logits=True)
    assert prompt.shape[0] > max_rows
    last = pool.step(decoder, [(s, ids[-1:]) for s, ids in enumerate(seqs)], all_logits=True)
    hf_bf16 = hf.to(torch.bfloat16)
    rows = len(seqs[0]) - 1
    for s, ids in enumerate(seqs):
        ours = torch.cat([prompt[s * rows : (s + 1) * rows], last[s : s + 1]])
        torch.testing.assert_close(ours, hf_logits(hf_bf16, ids), atol=0.1, rtol=0.05)


@needs_onednn_bf16
def test_bfloat16_float32_gemm_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    monkeypatch.setenv("MSTAR_CPU_BF16_FLOAT32_GEMM", "0")
    make_checkpoint(tmp_path, "llama")
    decoder, _, _ = load_model(tmp_path, "bfloat16")
    layer = decoder.layers[0].gate_up_proj
    assert isinstance(layer, PackedLinear) and not layer.upcast
    assert layer.packed_weight.dtype == torch.bfloat16


@needs_onednn_bf16
def test_bfloat16_float32_gemm_rounds_a_float32_product_to_bf16():
    """From BF16_FLOAT32_GEMM_MIN_ROWS rows: the float32 product of the exact bf16 values,
    rounded once to bf16; one row stays on oneDNN's bf16 kernel over the bf16 weight."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    layer = PackedLinear(linear, float32_gemm=True)
    assert layer.packed_weight.dtype == torch.float32
    many = torch.randn(BF16_FLOAT32_GEMM_MIN_ROWS * 8, 64, generator=gen).to(torch.bfloat16)
    got = layer(many)
    assert got.dtype == torch.bfloat16
    exact = many.double() @ linear.weight.detach().double().T + linear.bias.detach().double()
    # float32 accumulation, then one bf16 rounding: within one bf16 ulp of the exact product.
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-4)
    one = many[:1]
    assert BF16_FLOAT32_GEMM_MIN_ROWS > 1
    bf16_kernel = torch.ops.mkldnn._linear_pointwise(
        one,
        torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
        linear.bias,
        "none",
        [],
        "",
    )
    assert torch.equal(layer(one), bf16_kernel)


def test_float32_packs_for_batches_and_keeps_plain_weights_for_few_rows(tmp_path):
    """Without the kernels, float32 layers run MKL's F.linear below float32_packed_min_rows()
    rows (Intel), oneDNN from there; where that is 0 (MKL slow at few rows) every batch takes
    oneDNN, no plain copy."""
    make_checkpoint(tmp_path, "llama")
    decoder, cfg, _ = load_model(tmp_path)
    assert isinstance(decoder.lm_head, PackedLinear)
    plain = decoder.layers[0].qkv_proj
    assert isinstance(plain, PackedLinear)
    linear = torch.nn.Linear(cfg.hidden_size, plain.out_features, bias=False)
    layer = PackedLinear(linear)  # no kernels: oneDNN and MKL only
    assert layer.small_batch_weight is None
    gen = torch.Generator().manual_seed(0)
    min_rows = float32_packed_min_rows()
    few = torch.randn(max(min_rows - 1, 1), cfg.hidden_size, generator=gen)
    many = torch.randn(INTEL_FLOAT32_PACKED_MIN_ROWS * 4, cfg.hidden_size, generator=gen)
    for x in (few, many):
        packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        if x.shape[0] < min_rows:
            assert layer.weight is not None and layer.weight.dtype == torch.float32
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
        else:
            assert torch.equal(layer(x), packed)
    if min_rows <= 1:
        assert layer.weight is None and layer.min_rows == 0


def test_float32_decode_sized_batches_take_the_fma_kernel(tmp_path):
    """With the kernels' FMA GEMM, float32 batches up to FLOAT32_FMA_MAX_ROWS rows run it over
    float32 panels (bias included), larger ones oneDNN's packed kernel, and no layer keeps a
    plain weight for MKL (the kernel takes those batches), on Intel or not."""
    kernels, layers = _kernel_layers(tmp_path, "float32")
    assert small_batch_kernel(kernels, dtype=torch.float32) == (
        (kernels.fma_linear, kernels.fma_pack_weight, FLOAT32_FMA_MAX_ROWS)
        if kernels.fma_available()
        else None
    )
    if not kernels.fma_available():
        pytest.skip(f"the {kernels.isa_level()} build has no FMA")
    gen = torch.Generator().manual_seed(5)
    for layer in layers:
        assert layer.small_batch_weight is not None
        assert layer.small_batch_linear == kernels.fma_linear and layer.weight is None
        assert layer.small_batch_weight.dtype == torch.float32
        for rows in (1, 9, FLOAT32_FMA_MAX_ROWS, FLOAT32_FMA_MAX_ROWS + 1):
            x = torch.randn(rows, layer.in_features, generator=gen)
            if rows <= FLOAT32_FMA_MAX_ROWS:
                want = kernels.fma_linear(
                    x, layer.small_batch_weight, layer.out_features, layer.bias
                )
            else:
                want = torch.ops.mkldnn._linear_pointwise(
                    x, layer.packed_weight, layer.bias, "none", [], ""
                )
            assert torch.equal(layer(x), want)
