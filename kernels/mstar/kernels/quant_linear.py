"""A linear layer over GGUF block-quantized weights, kept as stored (`QuantLinear`).

Decode speed at small batch is set by the bytes a step reads: a Q4_1 weight is 0.28x of its bf16
copy, a Q8_0 one 0.53x. The weight stays in the GGUF file's blocks (ggml's layout, a row of
``in_features / block`` whole blocks per output), and `cpu_kernels`' ``quant_linear``
multiplies them as they are: x's rows are quantized to 8 bits per 32 values once per call and
each group's dot product is an integer one (AVX2 ``VPMADDUBSW``, AVX512-VNNI ``VPDPBUSD``; plain
C++ on the x86-64 baseline), as llama.cpp's CPU backend does; batches of 8 rows or more take a
tile of weight rows unpacked once against every row (`csrc/quant_tile.h`). Batches from
`DEQUANT_MIN_ROWS` rows (long prompt chunks; 64 where the CPU has AMX) dequantize the weight into
a scratch copy in x's dtype and take torch's GEMM (float32 where oneDNN has no bf16 GEMM: AVX2).

Types: ggml's ids (``gguf.GGMLQuantizationType``), the ones files users have: Q8_0, Q4_0, Q4_1
(the default model), Q4_K, Q5_K, Q6_K (Q4_K_M / Q5_K_M files mix them), and Q5_0 / Q5_1, which
llama.cpp stores instead of Q4_K / Q5_K where a row is not whole 256-value super-blocks (Gemma 3
270M's width 640, SmolLM2's 576).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from mstar.kernels import cpu_isa

#: the types served here (their block sizes: ``gguf.GGML_QUANT_SIZES``, which the C++ side,
#: `csrc/quant_gemm.cpp`, checks again on every call)
SERVED = tuple(
    GGMLQuantizationType[name]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)

#: Batches from this many rows dequantize the weight and run torch's GEMM instead of the
#: integer kernels (whose batches from 8 rows take the tiles: each weight block unpacked once
#: per call for all rows). `bench/bench_quant.py`'s row sweep over the Q4_1 file's 30 layers,
#: one thread of a 2-core Zen 4, bf16 x: integer 82 / 147 / 283 ms against 98 / 174 / 318 ms
#: for the dequantized weight and oneDNN's bf16 GEMM at 64 / 128 / 256 rows (avx512-bf16);
#: 129 / 249 against 200 / 360 at 64 / 128 (x86-64-v3, oneDNN's float32 GEMM capped at AVX2).
DEQUANT_MIN_ROWS = 512
#: Where the CPU has AMX tiles, whose bf16 GEMM runs several times VNNI's integer rate, prompt
#: chunks from this many rows take the dequantized weight (not measured: no AMX on this host).
DEQUANT_MIN_ROWS_AMX = 64


def served(qtype: int) -> bool:
    """True for a ggml type id `QuantLinear` multiplies as stored."""
    return int(qtype) in SERVED


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` values of ``qtype``; ValueError naming the
    type when it is not served or the row is not whole blocks."""
    if not served(qtype):
        names = ", ".join(t.name for t in SERVED)
        known = int(qtype) in GGMLQuantizationType._value2member_map_
        label = GGMLQuantizationType(qtype).name if known else f"id {int(qtype)}"
        raise ValueError(f"quantization type {label} is not served (one of: {names})")
    qtype = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if in_features <= 0 or in_features % block:
        raise ValueError(f"{qtype.name}: in_features {in_features} is not a multiple of {block}")
    return in_features // block * size


class QuantLinear(nn.Module):
    """``y = x @ W.T + bias`` with W [out_features, in_features] in GGUF blocks of ``qtype``.

    ``blocks``: uint8 [out_features, row_bytes] (a GGUF tensor's raw data, rows of whole
    blocks), held as is: the layer's resident size is the file's. ``forward`` takes float32 or
    bf16 x of any leading shape and returns x's dtype; ``bias`` (optional) is cast to it.
    ``kernels``: `cpu_kernels.load()`'s extension (or one level's, `cpu_kernels.load_level`).
    """

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        blocks: torch.Tensor,
        qtype: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        kernels: Any,
    ) -> None:
        super().__init__()
        size = row_bytes(qtype, in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != size:
            raise ValueError(
                f"blocks must be uint8 [out_features, {size}] for {in_features} inputs of "
                f"{GGMLQuantizationType(qtype).name}; got {blocks.dtype} {tuple(blocks.shape)}"
            )
        self.qtype = int(qtype)
        self.in_features = in_features
        self.out_features = int(blocks.shape[0])
        self.kernels = kernels
        features = cpu_isa.planning_features()
        self.onednn_bf16 = features.onednn_bf16
        self.amx = {"amx_tile", "amx_bf16"} <= features.flags
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out_features, in_features] in ``dtype`` (float32 or bf16), ggml's values."""
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        self.kernels.quant_dequantize_(self.blocks, self.qtype, out)
        return out

    @property
    def dequant_min_rows(self) -> int:
        """Rows from which a batch takes the dequantized weight's GEMM."""
        return DEQUANT_MIN_ROWS_AMX if self.amx else DEQUANT_MIN_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2 and x.stride(-1) == 1  # a decode step's [T, K]: used as is
        x2 = x if flat else x.reshape(-1, self.in_features).contiguous()
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if x2.shape[0] < self.dequant_min_rows:
            y = self.kernels.quant_linear(
                x2, self.blocks, self.qtype, self.out_features, self.in_features, bias
            )
        elif x.dtype == torch.bfloat16 and not self.onednn_bf16:
            # no bf16 GEMM in oneDNN here (AVX2): float32 product, rounded to bf16 once
            f32_bias = None if bias is None else bias.float()
            y = F.linear(x2.float(), self.dequantize(torch.float32), f32_bias).to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize(x.dtype), bias)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        name = GGMLQuantizationType(self.qtype).name
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={name}"
