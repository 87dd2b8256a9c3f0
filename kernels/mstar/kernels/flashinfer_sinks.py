"""Attention sinks (gpt-oss) on FlashInfer's wrappers, from the log-sum-exp they return.

A sink is one more logit per query head in each softmax's denominator that weighs no value
(`attention_sinks.softmax_with_sinks`). With ``Z`` the sum of ``exp`` over the row's scaled
scores, the sink only shrinks the output: ``out_sinks = out * Z / (Z + exp(sink)) =
out * sigmoid(ln Z - sink)``. FlashInfer's prefill and decode wrappers return ``ln Z`` on
request (``return_lse=True``) in base 2 (its online softmax runs in ``exp2`` over scores
pre-scaled by ``log2 e``: ``lse = m + log2(d)``), so every wrapper the backend plans, the
CUDA-graph decode one included, takes sinks with one elementwise step after its kernel: no
extra pass over the keys, nothing read back to the host, capturable.
"""

from __future__ import annotations

import math
from typing import Any

import torch

LN2 = math.log(2.0)


def apply_sinks(out: torch.Tensor, lse2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` [T, Hq, D] (softmax over the keys alone) rescaled as if each head's sink joined
    the denominator: ``lse2`` [T, Hq] the base-2 log-sum-exp of the scaled scores, ``sinks``
    [Hq] float32 logits; in ``out``'s dtype, the factor in float32."""
    factor = torch.sigmoid(lse2.float() * LN2 - sinks.float().view(1, -1))
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


def run_with_sinks(
    wrapper: Any, q: torch.Tensor, kv_layer: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """A planned FlashInfer wrapper's attention of q [T, Hq, D] with sinks [Hq]."""
    out, lse = wrapper.run(q, kv_layer, return_lse=True)
    return apply_sinks(out, lse, sinks)
