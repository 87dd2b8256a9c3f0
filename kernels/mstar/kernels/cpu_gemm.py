"""CPU GEMM selection: which kernel multiplies a linear layer's batch, chosen by the CPU.

oneDNN's packed kernels serve prompt chunks and, where mstar has nothing faster, every batch;
mstar's own GEMMs (`cpu_kernels`: AMX tiles, VDPBF16PS, FMA on widened bf16 or on float32)
serve decode-sized batches, where a step's time is streaming the weights from DRAM once. Every
choice takes the CPU's features as a value (`cpu_isa.CpuFeatures`), so the tests check the
choice any CPU would get, not only this machine's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels import cpu_isa

#: float32 batches below this many rows keep MKL's ``F.linear`` on Intel CPUs: measured on a
#: 2-core AVX-512 Xeon over SmolLM2's four projections, oneDNN's packed float32 kernel is 1.45x
#: slower at 1-2 rows and 1.35x / 1.27x / 1.14x faster at 8 / 32 / 64 (the LM head: 2.0x faster
#: at 8). Elsewhere MKL's sgemm is slow at few rows: on a 2-core AMD EPYC (Zen 4) the packed
#: kernel was 1.5x / 2.8x / 3.2x faster at 1 / 2 / 4 rows, so every batch takes it.
INTEL_FLOAT32_PACKED_MIN_ROWS = 8


def float32_packed_min_rows(features: cpu_isa.CpuFeatures | None = None) -> int:
    """Rows from which float32 linears take oneDNN's packed kernel (see the constant above)."""
    features = features or cpu_isa.planning_features()
    intel = (
        features.intel or not features.vendor
    )  # unknown: both kernels, the choice measured first
    return INTEL_FLOAT32_PACKED_MIN_ROWS if intel else 0


#: Where the CPU has no bf16 math, bf16 batches from this many rows multiply float32 copies of
#: their weights. oneDNN emulates bf16 GEMMs there: on a 2-core AVX-512 Xeon without
#: AVX512-BF16, SmolLM2's linears ran 1.4x / 3.6x / 4.3x slower than float32 at 2 / 32 / 64
#: rows. One row stays on the bf16 weight: it reads half the bytes, and in the engine a
#: one-sequence decode step took 30 ms that way against 40 ms on float32 weights.
BF16_FLOAT32_GEMM_MIN_ROWS = 2


#: bf16 batches up to this many rows run `cpu_kernels.amx_linear` where the CPU has AMX tiles
#: (a decode step's shapes: weights stream from DRAM once for a few dozen rows). Measured on a
#: 2-core Xeon with AMX over SmolLM2's linears, weights cold: a step's 121 linears took
#: 12.9 / 13.4 / 19.7 / 31.8 / 55.0 ms against oneDNN's 20.4 / 23.8 / 28.0 / 37.9 / 59.7 at
#: 1 / 32 / 64 / 128 / 256 rows, but from 128 rows up the LM head alone was slower (8.1 vs
#: 7.0 ms at 128, 15.7 vs 10.3 at 256).
AMX_MAX_ROWS = 128

#: Projections up to `AMX_PROMPT_MAX_N` outputs and `AMX_PROMPT_MAX_K` inputs take the AMX
#: kernel up to this many rows: prompt chunks of a few hundred tokens too, where oneDNN's kernel
#: is slow. SmolLM2's four projections per layer on a 2-core Xeon with AMX: 0.54 / 0.98 / 1.62 /
#: 2.62 / 4.35 ms against oneDNN's 0.71 / 1.20 / 1.98 / 7.15 / 4.99 at 128 / 256 / 512 / 768 /
#: 1024 rows, but 7.66 against 5.35 at 1,536; whole prompt-only engine steps of 384 / 512 / 768
#: tokens took 81-85 / 97 / 156-178 ms against 114-115 / 140-149 / 222-238. The wide gate/up
#: projection (N 3,072) is the exception: the tiles reach ~2.1 TFLOPS there against ~2.8 at N
#: 576-960 (likely its 3 MB of output pushing x out of L2: non-temporal stores won back ~10%
#: there; blocking the rows did not help), and
#: oneDNN's kernel is 9-45% faster from 135 rows up (0.73 against 0.87 ms at 519 rows, 1.25
#: against 1.79 at 1,031); sending it there took prompt-only steps of 512 / 768 / 1,024 tokens
#: from 90-96 / 138-141 / 187 ms to 90 / 132 / 170. Measured for SmolLM2's shapes only (K 576
#: and 1,536): larger layers keep `AMX_MAX_ROWS`.
AMX_PROMPT_MAX_ROWS = 1024
AMX_PROMPT_MAX_N = 2048
AMX_PROMPT_MAX_K = 2048

#: Where the CPU has AVX512-BF16 but no AMX, bf16 batches up to this many rows run
#: `cpu_kernels.dpbf16_linear`. Measured on a 2-core Zen 5 over SmolLM2's 120 projections,
#: weights cold: 5.6 / 5.0 / 9.6 / 18.2 / 34.0 ms against oneDNN's 8.7 / 8.1 / 14.0 / 23.4 /
#: 38.4 at 1 / 8 / 32 / 64 / 128 rows; at 256 rows oneDNN's kernel was ahead (gate/up: 1.06 vs
#: 1.27 ms), and prompt chunks are its ground.
DPBF16_MAX_ROWS = 128


#: Where the CPU has neither bf16 dot products nor a oneDNN bf16 GEMM (AVX2: oneDNN refuses bf16
#: without AVX512 BW/VL/DQ or AVX-NE-CONVERT), bf16 batches up to this many rows run
#: `cpu_kernels.fma_linear` over the bf16 weights, widened in registers; larger batches (prompt
#: chunks) multiply float32 copies of the weights with oneDNN's float32 kernel. Measured with the
#: x86-64-v3 build (8-lane vectors) and oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) on a
#: 2-core Zen 5, SmolLM2's 120 projections and LM head against oneDNN float32 on float32 copies:
#: 11.5 vs 34.8 ms at 1 row, 19.5 vs 54.2 at 8, 50.9 vs 81.5 at 32 (load ~4); 129 vs 166 at 64,
#: 250 vs 400 at 128, but 1299 vs 1025 at 512 (load ~1.7).
FMA_MAX_ROWS = 128

#: Where the CPU has AVX-512 but no bf16 math (Skylake-SP, Cascade Lake: oneDNN emulates bf16
#: GEMMs, 2-3x slower than its float32 kernel), bf16 batches up to this many rows run
#: `cpu_kernels.fma_linear` (the x86-64-v4 build: zmm vectors, two accumulator chains) and
#: larger ones the float32 GEMM on float32 copies, whose AVX-512 kernel overtakes it sooner than
#: the AVX2 one does. Measured with the x86-64-v4 build and oneDNN capped at AVX512_CORE on a
#: 2-core Xeon, SmolLM2's 210 projections and LM head, weights cold: 10.0 / 18.2 / 54.7 / 61.6 /
#: 78.4 / 100.8 ms against oneDNN float32's 27.9 / 34.7 / 58.9 / 68.4 / 77.6 / 93.5 (and its
#: emulated bf16's 19.4 / 59.2 / 162 / 186 / 220 / 283) at 1 / 8 / 32 / 40 / 48 / 64 rows.
FMA_MAX_ROWS_AVX512 = 40


#: float32 batches up to this many rows run `cpu_kernels.fma_linear` over float32 panels
#: wherever the kernels have FMA (x86-64-v3 and up): oneDNN's packed float32 kernel streamed a
#: one-row batch's weights at about half of DRAM bandwidth. Measured on a 2-core Zen 5 over
#: SmolLM2's 120 projections and LM head, weights cold, against oneDNN's packed kernel: at
#: avx512-bf16 15.2 / 14.7 / 26.8 / 52.4 / 104 / 218 ms against 26.4 / 29.5 / 40.5 / 57.0 /
#: 107 / 203 at 1 / 8 / 16 / 32 / 64 / 128 rows; at x86-64-v3 with oneDNN capped at AVX2
#: 18.4 / 25.4 / 32.6 / 70.7 / 113 / 224 against 27.8 / 37.3 / 49.6 / 67.8 / 133 / 246. Prompt
#: chunks stay oneDNN's. Intel CPUs were not measured (MKL's F.linear is theirs below
#: `INTEL_FLOAT32_PACKED_MIN_ROWS` otherwise).
FLOAT32_FMA_MAX_ROWS = 64


def small_batch_kernel(
    kernels: Any | None,
    features: cpu_isa.CpuFeatures | None = None,
    dtype: torch.dtype = torch.bfloat16,
    shape: tuple[int, int] | None = None,
) -> tuple[Any, Any, int] | None:
    """(linear, pack_weight, max rows) of the GEMM for decode-sized batches of ``dtype`` on
    this CPU. bf16: AMX tiles where it has them, else VDPBF16PS, else (no bf16 math: AVX2, or
    AVX-512 where oneDNN only emulates bf16) FMA on widened bf16. float32: FMA over float32
    panels. None: oneDNN's kernel for every batch. ``shape`` (out, in features): on AMX a
    layer within `AMX_PROMPT_MAX_N` x `AMX_PROMPT_MAX_K` takes prompt chunks too."""
    if kernels is None:
        return None
    if dtype == torch.float32:
        if not kernels.fma_available():
            return None
        return kernels.fma_linear, kernels.fma_pack_weight, FLOAT32_FMA_MAX_ROWS
    if dtype != torch.bfloat16:
        return None
    features = features or cpu_isa.planning_features()
    if kernels.amx_available():
        prompt = shape is not None and shape[0] <= AMX_PROMPT_MAX_N and shape[1] <= AMX_PROMPT_MAX_K
        rows = AMX_PROMPT_MAX_ROWS if prompt else AMX_MAX_ROWS
        return kernels.amx_linear, kernels.amx_pack_weight, rows
    if kernels.dpbf16_available():
        return kernels.dpbf16_linear, kernels.dpbf16_pack_weight, DPBF16_MAX_ROWS
    if kernels.fma_available():
        rows = FMA_MAX_ROWS_AVX512 if "avx512f" in features.flags else FMA_MAX_ROWS
        return kernels.fma_linear, kernels.fma_pack_weight, rows
    return None


def deterministic_kernel(kernels: Any | None) -> tuple[Any, Any] | None:
    """(linear, pack_weight) of the bf16 GEMM that ``--deterministic`` runs for every row count:
    VDPBF16PS where the CPU has it, else FMA on widened bf16, else None (refused). Each output
    element of either is one float32 sum over K in a fixed order, whatever the row count or a
    row's place in the batch (checked bitwise by the tests); oneDNN promises no such thing, and
    the AMX kernel is not row-invariant (a one-row batch runs VDPBF16PS, more rows the tiles),
    so AMX CPUs take VDPBF16PS too."""
    if kernels is None:
        return None
    if kernels.dpbf16_available():
        return kernels.dpbf16_linear, kernels.dpbf16_pack_weight
    if kernels.fma_available():
        return kernels.fma_linear, kernels.fma_pack_weight
    return None


def cpu_has_bf16() -> bool:
    """Native bf16 math (AVX512-BF16 or AMX); without it bf16 GEMMs widen to float32."""
    return cpu_isa.planning_features().bf16_math


def cpu_prefers_bf16(kernels: Any | None) -> bool:
    """bf16 is the faster dtype on this CPU: it has native bf16 math, or the kernels'
    `fma_linear` reads half-size bf16 weights for decode-sized batches (prompt chunks run
    float32 GEMMs on float32 copies, never oneDNN's emulated bf16). Measured with the
    x86-64-v3 build and oneDNN/ATen capped at AVX2 on a 2-core Zen 5, offline SmolLM2, best of
    2: bf16 40.6 tok/s against float32's 18.4 at batch 1, 80.7 against 81.8 at batch 32; with
    the x86-64-v4 build and oneDNN capped at AVX512_CORE on a 2-core Xeon (bench_levels, best of
    3): 11.0 against 19.5 ms per token at batch 1, 297 against 320 tok/s at batch 32."""
    features = cpu_isa.planning_features()
    if features.bf16_math:
        return True
    return kernels is not None and bool(kernels.fma_available())


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class PackedLinear(nn.Module):
    """A CPU linear whose weight oneDNN reorders once, at load, into its blocked layout.

    ``F.linear`` re-lays a bf16 weight out on every call; that made SmolLM2's bf16 linears 1.6x
    slower at one token and 2.2x at 32 (micro-benchmark on a 2-core AVX-512 Xeon). In float32,
    on Intel, oneDNN wins only from `float32_packed_min_rows` rows up, so without the kernels'
    float32 GEMM a float32 layer there keeps its plain weight too and small batches use it.
    Packed results are rounded differently from ``F.linear``'s (not bit-identical); the
    exactness tests against transformers cover both.

    ``float32_gemm`` (bf16 weights on a CPU without bf16 math, see `BF16_FLOAT32_GEMM_MIN_ROWS`):
    batches from that many rows run a float32 GEMM on exact float32 copies of the bf16 weight
    and input, rounding the output to bf16. That is a bf16 GEMM with float32 accumulation, what
    oneDNN's emulation computes, at float32 speed; it costs a float32 copy of every weight.
    Where oneDNN has no bf16 GEMM at all (``features.onednn_bf16`` false: AVX2) every batch past
    the small-batch kernel takes that route, whatever ``float32_gemm`` says.

    ``kernels`` (`cpu_kernels.load()`'s extension): where `small_batch_kernel` finds one (bf16:
    AMX tiles, AVX512-BF16, or FMA without bf16 math; float32: FMA), a layer also keeps
    its weight in that kernel's layout (``small_batch_weight``), and batches up to its row
    limit run it (the same float32 accumulation rounded once).

    ``deterministic``: every batch runs `deterministic_kernel`, so a row's output bits do not
    depend on the batch it is in; bf16 only (ValueError otherwise, or without such a kernel).
    """

    packed_weight: torch.Tensor
    small_batch_weight: torch.Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        *,
        float32_gemm: bool = False,
        kernels: Any | None = None,
        features: cpu_isa.CpuFeatures | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        features = features or cpu_isa.planning_features()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = linear.bias
        self.small_batch_linear: Any | None = None
        self.small_batch_max_rows = 0
        if deterministic:
            self._init_deterministic(weight, kernels)
            return
        self.min_rows = 0
        self.weight: torch.Tensor | None = None
        self.few_rows_weight: torch.Tensor | None = None
        self.float32_bias: torch.Tensor | None = None
        #: batches past the small-batch kernel run a float32 GEMM (see ``float32_gemm``)
        self.upcast = weight.dtype == torch.bfloat16 and (float32_gemm or not features.onednn_bf16)
        shape = (self.out_features, self.in_features)
        kernel = small_batch_kernel(kernels, features, weight.dtype, shape)
        if kernel is not None:
            self.small_batch_linear, _, self.small_batch_max_rows = kernel
        # (the float32 small-batch kernel takes every batch MKL's few-rows path would)
        if (
            weight.dtype == torch.float32
            and kernel is None
            and float32_packed_min_rows(features) > 1
        ):
            self.min_rows = float32_packed_min_rows(features)
            self.weight = linear.weight
        elif self.upcast:
            if features.onednn_bf16 and kernel is None:  # one row on the bf16 weight
                self.min_rows = BF16_FLOAT32_GEMM_MIN_ROWS
                self.few_rows_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if linear.bias is not None:
                self.float32_bias = linear.bias.detach().float()
        packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.float() if self.upcast else weight, None
        )
        self.register_buffer("packed_weight", packed, persistent=False)
        small = None if kernel is None else kernel[1](weight)
        self.register_buffer("small_batch_weight", small, persistent=False)

    def _init_deterministic(self, weight: torch.Tensor, kernels: Any | None) -> None:
        """One kernel for every row count, and no oneDNN copy of the weight (never used)."""
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"deterministic CPU GEMMs are bf16 only, not {weight.dtype}")
        kernel = deterministic_kernel(kernels)
        if kernel is None:
            raise ValueError("deterministic CPU GEMMs need the C++ kernels' VDPBF16PS or FMA GEMM")
        self.small_batch_linear, pack = kernel
        self.small_batch_max_rows = sys.maxsize
        self.min_rows = 0
        self.upcast = False
        self.weight = self.few_rows_weight = self.float32_bias = None
        self.register_buffer("packed_weight", torch.empty(0), persistent=False)
        self.register_buffer("small_batch_weight", pack(weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_batch_weight is not None and x.shape[0] <= self.small_batch_max_rows:
            assert self.small_batch_linear is not None
            out: torch.Tensor = self.small_batch_linear(
                x, self.small_batch_weight, self.out_features, self.bias
            )
            return out
        if x.shape[0] < self.min_rows:
            if self.weight is not None:
                return F.linear(x, self.weight, self.bias)
            assert self.few_rows_weight is not None
            return _onednn_linear(x, self.few_rows_weight, self.bias)
        if self.upcast:
            out = _onednn_linear(x.float(), self.packed_weight, self.float32_bias)
            return out.to(x.dtype)
        return _onednn_linear(x, self.packed_weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing pays for bf16 and (from a few rows up) float32 on CPU."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )
