"""The torch backend's bf16/fp16 decode rows keep scores and probabilities in float32.

FlashInfer and the CPU kernels do; a torch path that rounded them to bf16 drifted from both by
more than the output's own rounding and flipped greedy tokens on sharp attention. Here every
output element must sit within half a unit in the last place of a float64 reference computed
from the same (bf16-valued) inputs: the one rounding of the final result, nothing more.
"""

from __future__ import annotations

import math

import pytest
import torch
from paged_cases import decode_case

from mstar.kernels import TorchPagedAttention

PAGE = 16
HQ, HKV, D = 9, 3, 64  # SmolLM2's heads


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of one query row [Hq, D] over k/v [L, Hkv, D]."""
    g = HQ // HKV
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), kk) / math.sqrt(D)
    return torch.einsum("hk,khd->hd", scores.softmax(-1), vv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_rows_are_rounded_once(dtype: torch.dtype, seed: int) -> None:
    lens = [200, 57, 130, 9, 1]
    # q scaled so the scores reach about +-20: sharp attention, where rounding shows
    pool, dense, q, plan = decode_case(
        lens, page_size=PAGE, heads=(HQ, HKV, D), seed=seed, dtype=dtype, q_scale=3.0
    )
    backend = TorchPagedAttention(use_kernels=False)  # the matmul path (CUDA's torch backend)
    backend.plan(*plan, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    out = backend.run(q, pool)
    assert out.dtype == dtype
    half_ulp = torch.finfo(dtype).eps / 2
    for i, (k, v) in enumerate(dense):
        ref = _reference(q[i], k, v)
        err = (out[i].double() - ref).abs()
        excess = err - (half_ulp * ref.abs() + 1e-5)
        assert float(excess.max()) <= 0, f"row {i}: {float(err.max()):.5f} beyond one rounding"
