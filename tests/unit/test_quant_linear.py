"""GGUF block-quantized GEMM (`cpu_kernels.quant_linear`, `QuantLinear`) at every ISA level the
CPU runs, per type, against the ``gguf`` package's own dequantization.

Weights of the types ``gguf`` can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) come from its
``quantize`` of a random float matrix; for the K-quants (it only dequantizes those) every byte
of every block is random except the float16 super-block scales (``d``, and ``dmin`` for Q4_K /
Q5_K), written as finite positive values, so every 6-bit scale and min, nibble and high bit
pattern occurs.

Three references: the kernels' dequantization equals ``gguf.quants.dequantize`` bit for bit;
the product equals, within float32 summation error, x quantized to 8 bits per 32 values the
kernel's way (then in float64) times the gguf weight; and it is within the bound that
quantizing x allows (half a step per value) of the float product x @ W.T.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from external_tools import require_tool
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from mstar.kernels import cpu_isa, cpu_kernels
from mstar.kernels.quant_linear import SERVED, QuantLinear, row_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

TYPE_NAMES = [t.name for t in SERVED]
#: (outputs, inputs): one row; an odd count of rows; several K-quant super-blocks per row
SHAPES = [(1, 256), (37, 512), (64, 768)]


@pytest.fixture(scope="module", params=[lvl.name for lvl in cpu_isa.supported_levels()])
def kernels(request):
    """Each ISA level's build this CPU runs; a build failure fails the tests."""
    require_tool("g++")
    require_tool("ninja")
    ext = cpu_kernels.load_level(cpu_isa.resolve(request.param))
    assert ext.isa_level() == request.param
    return ext


def make_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """W [n, k] of type ``name`` as GGUF stores it: uint8 [n, row bytes]."""
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        return quantize(w, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(2.0**-10, 2.0**-7, (n, k // block, 2)).astype(np.float16)
    if name == "Q6_K":
        raw[..., 208:210] = scales[..., :1].view(np.uint8)
    else:
        raw[..., 0:4] = scales.view(np.uint8).reshape(n, k // block, 4)
    return raw.reshape(n, -1)


def gguf_weight(blocks: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(dequantize(blocks, GGMLQuantizationType[name]), dtype=np.float32)


def quantized_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 as the kernel quantizes it (8 bits per 32 values, round half to even),
    back in float64; and each group's step d [M, K / 32]."""
    groups = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(groups * inv)
    d = amax / np.float32(127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape), d[..., 0]


@pytest.mark.parametrize("name", TYPE_NAMES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_dequantize_equals_gguf(kernels, name, n, k):
    blocks = make_blocks(name, n, k)
    ref = torch.from_numpy(gguf_weight(blocks, name))
    layer = QuantLinear(torch.from_numpy(blocks), GGMLQuantizationType[name], k, kernels=kernels)
    assert torch.equal(layer.dequantize(torch.float32), ref)
    assert torch.equal(layer.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("name", TYPE_NAMES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES[1:])
def test_quant_linear_matches_the_references(kernels, name, rows, dtype, n, k):
    """1-4 rows: the 4-row kernel; 9, 17, 40: the batched tiles (8 or more rows), with partial
    tiles of activation rows and of weight rows (37 outputs)."""
    blocks = make_blocks(name, n, k, seed=rows)
    w = gguf_weight(blocks, name).astype(np.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = kernels.quant_linear(x, torch.from_numpy(blocks), GGMLQuantizationType[name], n, k, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    got = y.double().numpy()
    xf = x.float().numpy()
    xq, d = quantized_x(xf)
    b = bias.double().numpy()
    # bf16 output: one rounding of the float32 result (relative 2^-8)
    out_round = np.abs(xq @ w.T + b) * (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    exact = xq @ w.T + b
    scale = np.abs(xq) @ np.abs(w).T + np.abs(b)
    assert np.all(np.abs(got - exact) <= 1e-5 * scale + out_round + 1e-6)
    # quantizing x moves each value by at most half a step of its group
    step = np.repeat(d, 32, axis=1).astype(np.float64) / 2
    bound = step @ np.abs(w).T
    assert np.all(
        np.abs(got - (xf.astype(np.float64) @ w.T + b)) <= bound * 1.0001 + out_round + 1e-5 * scale
    )


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_quant_layer_forward_few_and_many_rows(kernels, name):
    """Decode-sized batches take the integer kernel, prompt-sized ones the dequantized weight;
    both give x @ W.T + bias for any leading shape."""
    n, k = 45, 256
    blocks = make_blocks(name, n, k, seed=3)
    bias = torch.randn(n)
    layer = QuantLinear(
        torch.from_numpy(blocks), GGMLQuantizationType[name], k, bias, kernels=kernels
    )
    w = torch.from_numpy(gguf_weight(blocks, name))
    for shape in [(1, k), (2, 3, k), (layer.dequant_min_rows + 5, k)]:
        x = torch.randn(*shape)
        y = layer(x)
        assert y.shape == (*shape[:-1], n)
        ref = F.linear(x, w, bias)
        tol = 2e-2 * (x.abs() @ w.abs().T).amax()
        assert (y - ref).abs().amax() <= tol
    many = torch.randn(layer.dequant_min_rows, k, dtype=torch.bfloat16)
    if cpu_isa.planning_features().onednn_bf16:
        want = F.linear(many, w.to(torch.bfloat16), bias.to(torch.bfloat16))
    else:  # AVX2: oneDNN has no bf16 GEMM; a float32 product rounded once
        want = F.linear(many.float(), w, bias.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(layer(many), want)


def test_vnni_runs_where_the_level_and_cpu_have_it(kernels):
    features = cpu_isa.detect()
    level = cpu_isa.resolve(kernels.isa_level())
    wide = "avx512f" in level.requires
    assert kernels.quant_vnni() == (wide and "avx512_vnni" in features.flags)


def test_bad_weights_are_refused_by_name(kernels):
    blocks = torch.from_numpy(make_blocks("Q4_1", 4, 64))
    with pytest.raises(ValueError, match="Q2_K"):
        row_bytes(GGMLQuantizationType.Q2_K, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(GGMLQuantizationType.Q4_K, 64)
    with pytest.raises(ValueError, match="uint8"):
        QuantLinear(blocks[:, :-1], GGMLQuantizationType.Q4_1, 64, kernels=kernels)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        kernels.quant_linear(x, blocks, GGMLQuantizationType.Q8_0, 4, 64, None)
    with pytest.raises(RuntimeError, match="not served"):
        kernels.quant_linear(x, blocks, GGMLQuantizationType.Q2_K, 4, 64, None)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.quant_linear(torch.randn(1, 32), blocks, GGMLQuantizationType.Q4_1, 4, 64, None)
