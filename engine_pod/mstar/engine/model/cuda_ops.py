"""FlashInfer's fused glue ops for the decoder layers on CUDA.

The layers take their glue ops (residual add + RMSNorm, SiLU * up, RoPE) from one provider,
the `kernels` argument: the C++ CPU extension on CPU. On CUDA in half precision this module
gives them FlashInfer's fused kernels instead: ``fused_add_rmsnorm`` (one kernel where the
torch ops launch 9: add, cast, pow, mean, add, rsqrt, mul, cast, mul), ``silu_and_mul`` (one
where torch launches 2) and ``apply_rope_with_cos_sin_cache_inplace`` (one, over the strided Q
and K views of the QKV output, where torch launches 8).

RoPE: the step's rows are not gathered from the tables (`RotaryEmbedding.lookup`); the
provider's `FusedGlueOps.rope_lookup` hands the layers the step's positions and the table's
float32 ``cos | sin`` cache (`RotaryEmbedding.cos_sin_cache`: the model-dtype table values,
widened), and FlashInfer gathers per row in the kernel, computing in float32.

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

from mstar.engine.model.rope import RotaryEmbedding, rotate_half_

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

    @staticmethod
    def apply_rope_with_cos_sin_cache_inplace(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None:
        """Rotate ``query`` / ``key`` [T, H * D] (or [T, H, D]) in place, row t by the float32
        ``cos_sin_cache[positions[t]]`` (cos half, then sin half), rotate_half layout."""
        assert is_neox, "the layers rotate halves (GPT-NeoX / HF layout)"
        half = cos_sin_cache.shape[-1] // 2
        rows = cos_sin_cache[positions]
        cos, sin = rows[:, None, :half], rows[:, None, half:]
        for x in (query, key):
            heads = x.view(x.shape[0], -1, head_size)
            if heads.dtype == torch.float32:
                rotate_half_(heads, cos, sin)
            else:  # FlashInfer computes in float32 and rounds once
                wide = heads.float()
                rotate_half_(wide, cos, sin)
                heads.copy_(wide)


class FusedGlueOps:
    """The layers' glue-op provider (`DecoderLayer`'s ``kernels``) over a fused-op library
    with FlashInfer's contracts: ``norm.fused_add_rmsnorm``, ``activation.silu_and_mul`` and
    (when given) ``rope.apply_rope_with_cos_sin_cache_inplace`` of the module given, or
    `ReferenceFused`'s. ``kv_heads``: the layers' KV heads (the last heads of the Q|K rows
    RoPE rotates); without ``rope`` the layers rotate with torch's ops."""

    def __init__(
        self, add_rmsnorm: Any, silu_and_mul: Any, rope: Any | None = None, kv_heads: int = 0
    ) -> None:
        self._add_rmsnorm = add_rmsnorm
        self._silu_and_mul = silu_and_mul
        self._rope = rope
        self.kv_heads = kv_heads
        if rope is not None and kv_heads < 1:
            raise ValueError("fused RoPE needs the layers' KV head count")
        #: calls per op, for the wiring tests and the device log
        self.calls = {"add_rms_norm_": 0, "silu_mul": 0, "rope_": 0}

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        self.calls["add_rms_norm_"] += 1
        self._add_rmsnorm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls["silu_mul"] += 1
        out: torch.Tensor = self._silu_and_mul(gate_up)
        return out

    def rope_lookup(
        self, table: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layers hand `rope_` this step: (positions, the table's float32 cos|sin
        cache) for the fused kernel, else the gathered rows (`RotaryEmbedding.lookup`)."""
        if self._rope is None:
            return table.lookup(positions)
        return positions, table.cos_sin_cache()

    def rope_(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Rotate the Q|K heads ``x`` [T, Hq + Hkv, D] in place: ``a``, ``b`` are what
        `rope_lookup` returned (positions and cache, or cos and sin rows)."""
        self.calls["rope_"] += 1
        if self._rope is None:
            rotate_half_(x, a, b)
            return
        hq = x.shape[1] - self.kv_heads
        self._rope(a, x[:, :hq], x[:, hq:], x.shape[-1], b, True)


def fused_glue_ops(
    device: torch.device, dtype: torch.dtype, kv_heads: int = 0
) -> FusedGlueOps | None:
    """FlashInfer's fused ops for a CUDA decoder in half precision (RoPE too when
    ``kv_heads`` is given); None elsewhere or when FlashInfer is not importable (the layers
    then run torch's ops)."""
    if device.type != "cuda" or dtype not in HALF:
        return None
    try:
        norm: ModuleType = importlib.import_module("flashinfer.norm")
        act: ModuleType = importlib.import_module("flashinfer.activation")
        rope: ModuleType = importlib.import_module("flashinfer.rope")
    except ImportError as exc:
        log.info("FlashInfer's fused norm/activation/RoPE unavailable (%s): torch glue ops", exc)
        return None
    fused_rope = rope.apply_rope_with_cos_sin_cache_inplace if kv_heads else None
    return FusedGlueOps(norm.fused_add_rmsnorm, act.silu_and_mul, fused_rope, kv_heads)


def attach_fused_glue_ops(
    decoder: Any, device: torch.device, dtype: torch.dtype, deterministic: bool
) -> bool:
    """Give a CUDA decoder FlashInfer's glue ops (its layers' ``kernels``); whether it did.
    Not in deterministic mode, whose residual handling assumes the CPU kernels."""
    if deterministic or decoder.cpu_kernels is not None:
        return False
    cfg = decoder.config
    # One RoPE table for every layer: FlashInfer's kernel takes one cache per call, and the
    # per-layer tables (Gemma 3's local and global) keep torch's rotation.
    one_table = len(decoder.ropes) == 1
    ops = fused_glue_ops(device, dtype, cfg.num_kv_heads if one_table else 0)
    if ops is None:
        return False
    decoder.cpu_kernels = ops
    if one_table:  # made now, not inside the first captured graph (which would recompute it)
        next(iter(decoder.ropes.values())).cos_sin_cache()
    rope = "RoPE" if one_table else "torch RoPE (per-layer tables)"
    log.info("decoder layers: FlashInfer fused add+RMSNorm, SiLU*up and %s", rope)
    return True
