"""Attention sinks on FlashInfer's wrappers (`flashinfer_sinks`), on CPU: an attention that
returns what FlashInfer's ``run(..., return_lse=True)`` returns (the output over the keys
alone and the base-2 log-sum-exp of the scaled scores), rescaled, equals
`attention_sinks.attend_with_sinks` (transformers' eager gpt-oss math) on GQA decode and
masked prefill rows; and a sink far below every score changes nothing, one far above empties
the row.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mstar.kernels.attention_sinks import attend_with_sinks
from mstar.kernels.flashinfer_sinks import apply_sinks, run_with_sinks

HQ, HKV, D = 8, 2, 16


class _FlashInferLike:
    """A planned wrapper's contract over one dense sequence: q [T, Hq, D] against k/v
    [L, Hkv, D] under ``mask`` [T, L]; ``return_lse`` adds the base-2 log-sum-exp [T, Hq]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
        self.k, self.v, self.mask, self.scale = k, v, mask, scale

    def run(self, q: torch.Tensor, kv_layer: Any, return_lse: bool = False) -> Any:
        group = HQ // HKV
        k = self.k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = self.v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(-1, -2)) * self.scale  # [Hq, T, L]
        scores = scores.masked_fill(~self.mask, float("-inf"))
        out = (torch.softmax(scores, -1) @ v).transpose(0, 1)  # [T, Hq, D]
        lse2 = (torch.logsumexp(scores, -1) / math.log(2.0)).t()  # [T, Hq]
        return (out, lse2) if return_lse else out


@pytest.mark.parametrize(("rows", "keys"), [(1, 1), (1, 37), (5, 12)])
def test_rescaled_output_equals_attention_with_sinks(rows: int, keys: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + keys)
    q = torch.randn(rows, HQ, D, generator=gen) * 2
    k = torch.randn(keys, HKV, D, generator=gen)
    v = torch.randn(keys, HKV, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) + 1.0
    # causal, each row the last ``rows`` keys' own position (a prefill chunk ending at ``keys``)
    pos = torch.arange(keys - rows, keys).unsqueeze(1)
    mask = torch.arange(keys).unsqueeze(0) <= pos
    scale = D**-0.5
    got = run_with_sinks(_FlashInferLike(k, v, mask, scale), q, None, sinks)
    want = attend_with_sinks(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), mask.view(1, 1, rows, keys), scale, sinks,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = _FlashInferLike(k, v, mask, scale).run(q, None)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks mattered


def test_extreme_sinks() -> None:
    out = torch.randn(3, HQ, D)
    lse2 = torch.randn(3, HQ)
    torch.testing.assert_close(apply_sinks(out, lse2, torch.full((HQ,), -1e4)), out)
    assert torch.equal(apply_sinks(out, lse2, torch.full((HQ,), 1e4)), torch.zeros_like(out))
    bf16 = apply_sinks(out.bfloat16(), lse2, torch.zeros(HQ))
    assert bf16.dtype == torch.bfloat16
