"""Rotary position embeddings (HF ``rotate_half`` convention) and their frequency variants.

Variants, each computed as transformers' ``modeling_rope_utils`` does (same float32 ops, so
the tables are the same bits): default, linear, Llama-3, YaRN and Phi-3's LongRoPE. LongRoPE
keeps two tables and picks the long one for positions at or past the pretraining length (per
position, as vLLM does; transformers switches a whole forward at once, so a sequence crossing
that length rotates its earlier keys differently there).

cos/sin are computed once for every position up to ``max_position_embeddings`` so a step only
gathers rows by position (once, in `lookup`, for every layer): sequences in a flat batch sit at
unrelated positions, so no per-step recomputation over a contiguous range would serve them all.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mstar.engine.model.config import RopeScaling
from mstar.kernels import cpu_kernels


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, *, long: bool = False
) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] in float32, scaled as the config asks
    (``long``: LongRoPE's table for positions past the pretraining length)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if scaling is not None and scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
        # between interpolated smoothly between the two.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


def _yarn(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: extrapolated (unscaled) high frequencies, interpolated low ones, a linear ramp
    between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original
    context."""
    orig = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class RotaryEmbedding:
    """Precomputed cos/sin tables [max_positions, head_dim] in the model dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        # An outer product, like HF's [d/2,1]@[1,T] matmul: each entry is one float32 product.
        freqs = pos[:, None] * inv_frequencies(head_dim, theta, scaling)[None, :]
        if scaling is not None and scaling.rope_type == "longrope":
            orig = scaling.original_max_position_embeddings
            long = pos[orig:, None] * inv_frequencies(head_dim, theta, scaling, long=True)
            freqs[orig:] = long
        half_cos = freqs.cos()
        half_sin = freqs.sin()
        factor = 1.0 if scaling is None else scaling.attention_factor
        if factor != 1.0:  # YaRN / LongRoPE scale cos and sin (HF: in float32, before the cast)
            half_cos, half_sin = half_cos * factor, half_sin * factor
        # Keep only the half tables: rotate_half's cos/sin are the same half repeated twice.
        self.cos = half_cos.to(dtype=dtype, device=device)
        self.sin = half_sin.to(dtype=dtype, device=device)
        self._cos_sin: torch.Tensor | None = None

    def cos_sin_cache(self) -> torch.Tensor:
        """float32 ``[max_positions, head_dim]``, cos half then sin half: the tables' values
        widened (made once), as FlashInfer's fused RoPE reads them (`cuda_ops`)."""
        if self._cos_sin is None:
            self._cos_sin = torch.cat([self.cos, self.sin], dim=-1).float().contiguous()
        return self._cos_sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D/2]`` at ``positions`` [T]: gathered once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, kernels: Any | None = None
    ) -> None:
        """Rotate ``x`` [T, H, D] in place by `lookup`'s tables (HF rotate_half layout).

        ``kernels`` (`cpu_kernels.load()`'s extension) does float32 or bf16 in one pass, same bits.
        """
        if kernels is not None and x.dtype in cpu_kernels.DTYPES:
            kernels.rope_(x, cos, sin)
            return
        rotate_half_(x, cos, sin)


def rotate_half_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`RotaryEmbedding.rotate_` in torch ops: ``x`` [T, H, D] in place, half tables."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    # Same products and sums as HF's x*cos + rotate_half(x)*sin, evaluated per half.
    new1 = x1 * cos - x2 * sin
    new2 = x2 * cos + x1 * sin
    x1.copy_(new1)
    x2.copy_(new2)
