"""Per-token FP8 (e4m3) activation quantization in one Triton kernel, for `Fp8Linear` on CUDA.

In torch ops the quantization before each FP8 GEMM is five to nine kernels (|x|, the row max,
the scale, the division, the clamp, the cast): at an 8B model's batch-1 step that is ~130
launches a layer pass of tiny kernels, more time than the GEMMs save. Here one program per
row loads the row once, takes its max |x| in float32, writes ``scale = max / 448`` (at least
``MIN_SCALE``) and ``clamp(x / scale, ±448)`` as e4m3: the numbers `quantize_activations` (the
torch reference in `mstar.engine.model.fp8`) computes, in one launch, capturable in a CUDA
graph. With ``static_scale`` every row takes that scale instead.

Triton is imported lazily (`load`): CPU hosts without it never touch this module's kernel;
the CPU tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

__all__ = ["available", "load"]

FP8_MAX = 448.0
MIN_SCALE = 1e-12


def available() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def load() -> Any:
    """The quantizer: ``quantize(x [M, K], static_scale | None) -> (e4m3 [M, K], f32 [M, 1])``
    (one per process: Triton compiles the kernel once per block size)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rows(x_ptr, q_ptr, s_ptr, static_ptr, k, stride_x, stride_q,
              STATIC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < k
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)  # FP8_MAX, MIN_SCALE
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    def quantize(
        x: torch.Tensor, static_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        static = static_scale if static_scale is not None else scale
        block = triton.next_power_of_2(k)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _rows[(m,)](x, q, scale, static, k, x.stride(0), q.stride(0),
                    STATIC=static_scale is not None, BLOCK=block, num_warps=warps)  # fmt: skip
        return q, scale

    return quantize
