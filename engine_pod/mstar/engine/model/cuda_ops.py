"""FlashInfer's fused glue ops for the decoder layers on CUDA.

The layers take their glue ops (residual add + RMSNorm, SiLU * up, RoPE) from one provider,
the `kernels` argument: the C++ CPU extension on CPU. On CUDA in half precision this module
gives them FlashInfer's fused kernels instead: ``fused_add_rmsnorm`` (one kernel where the
torch ops launch 9: add, cast, pow, mean, add, rsqrt, mul, cast, mul) and ``silu_and_mul``
(one where torch launches 2). RoPE stays torch's here (FlashInfer's in-place RoPE takes
positions and its own cos/sin cache, not the gathered rows the layers hand over).

`ReferenceFused` is the same contract in plain torch: the CPU tests run the layers through
`FusedGlueOps` over it against the unfused ops, and a fake module checks the CUDA selection.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from mstar.engine.model.rope import rotate_half_

log = logging.getLogger(__name__)

__all__ = ["FusedGlueOps", "ReferenceFused", "attach_fused_glue_ops", "fused_glue_ops"]

#: Where the layers hand glue ops to their provider (`cpu_kernels.DTYPES`) and FlashInfer's
#: kernels take the dtype: bf16 (float16 keeps torch's ops).
HALF = (torch.bfloat16,)


class ReferenceFused:
    """FlashInfer's ``fused_add_rmsnorm`` / ``silu_and_mul`` contracts in plain torch."""

    @staticmethod
    def fused_add_rmsnorm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: ``residual += x``, then ``x = rmsnorm(residual) * weight``."""
        residual.add_(x)
        x.copy_(F.rms_norm(residual.float(), weight.shape, weight.float(), eps))

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of rows holding [gate | up]."""
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :half]) * gate_up[..., half:]


class FusedGlueOps:
    """The layers' glue-op provider (`DecoderLayer`'s ``kernels``) over a fused-op library
    with FlashInfer's contracts: ``norm.fused_add_rmsnorm`` and ``activation.silu_and_mul``
    of the module given, or `ReferenceFused`'s."""

    def __init__(self, add_rmsnorm: Any, silu_and_mul: Any) -> None:
        self._add_rmsnorm = add_rmsnorm
        self._silu_and_mul = silu_and_mul
        #: calls per op, for the wiring tests and the device log
        self.calls = {"add_rms_norm_": 0, "silu_mul": 0}

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        self.calls["add_rms_norm_"] += 1
        self._add_rmsnorm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls["silu_mul"] += 1
        out: torch.Tensor = self._silu_and_mul(gate_up)
        return out

    #: RoPE stays torch's (see the module docstring)
    rope_ = staticmethod(rotate_half_)


def fused_glue_ops(device: torch.device, dtype: torch.dtype) -> FusedGlueOps | None:
    """FlashInfer's fused ops for a CUDA decoder in half precision; None elsewhere or when
    FlashInfer is not importable (the layers then run torch's ops)."""
    if device.type != "cuda" or dtype not in HALF:
        return None
    try:
        norm: ModuleType = importlib.import_module("flashinfer.norm")
        act: ModuleType = importlib.import_module("flashinfer.activation")
    except ImportError as exc:
        log.info("FlashInfer's fused norm/activation unavailable (%s): torch glue ops", exc)
        return None
    return FusedGlueOps(norm.fused_add_rmsnorm, act.silu_and_mul)


def attach_fused_glue_ops(
    decoder: Any, device: torch.device, dtype: torch.dtype, deterministic: bool
) -> bool:
    """Give a CUDA decoder FlashInfer's glue ops (its layers' ``kernels``); whether it did.
    Not in deterministic mode, whose residual handling assumes the CPU kernels."""
    if deterministic or decoder.cpu_kernels is not None:
        return False
    ops = fused_glue_ops(device, dtype)
    if ops is None:
        return False
    decoder.cpu_kernels = ops
    log.info("decoder layers: FlashInfer fused add+RMSNorm and SiLU*up")
    return True
