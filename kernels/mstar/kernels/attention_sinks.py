"""Attention sinks (gpt-oss) on the torch paths: a learned logit per query head that joins
each softmax's max and denominator and weighs no value, as transformers' eager gpt-oss
attention computes it (one more score column, dropped after the softmax). The C++ kernels
take the same logits as `paged_decode` / `paged_prefill`'s ``sinks``."""

from __future__ import annotations

import torch


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over ``scores`` [..., L] and one sink column ``sinks`` [..., 1] (broadcast to
    the scores' leading shape), the sink's share dropped: [..., L], float32."""
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores.float(), sink), dim=-1), dim=-1)[..., :-1]


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Masked attention of q [1, Hq, n, D] over k, v [1, Hkv, L, D] (``mask`` bool, True where
    a key is seen) with sinks [Hq], in float32; [1, Hq, n, D] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, sinks.view(1, -1, 1, 1))
    return (probs @ vf).to(q.dtype)
