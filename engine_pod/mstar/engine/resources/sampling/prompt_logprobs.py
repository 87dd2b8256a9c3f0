"""Scoring prompt tokens: the logprob of each prompt token given the ones before it.

A prefill step computes the logits of the positions it scores beside the rows it samples
(`ModelRunner`); this turns those rows into `TokenLogprob`s. Raw logprobs, the log-softmax of
the model's logits, as `ops.logprobs_of` gives for sampled tokens and vLLM gives for
`prompt_logprobs`: no temperature, penalty or bias applies to a prompt.
"""

from __future__ import annotations

import torch

from mstar.engine.outputs import TokenLogprob
from mstar.engine.resources.host_copy import to_device
from mstar.engine.resources.sampling import ops

#: Rows widened to float32 at a time: bounds the work copy (rows x vocab x 4 bytes: 25 MB at
#: SmolLM2's 49,152) whatever the step scores.
SLICE_ROWS = 128


def score_prompt_rows(
    logits: torch.Tensor, targets: list[list[int]], tops: list[int]
) -> list[list[TokenLogprob]]:
    """``logits`` [sum of len(targets[i]), vocab], one row per scored position in order; per
    group ``i``, each target's logprob, rank and ``tops[i]`` most likely alternatives."""
    flat_targets = [t for group in targets for t in group]
    k_of = [k for group, k in zip(targets, tops, strict=True) for _ in group]
    kmax = max(tops, default=0)
    chosen: list[float] = []
    ranks: list[int] = []
    top_v: list[list[float]] = []
    top_i: list[list[int]] = []
    for start in range(0, len(flat_targets), SLICE_ROWS):
        rows = logits[start : start + SLICE_ROWS]
        want = to_device(flat_targets[start : start + SLICE_ROWS], torch.int64, logits.device)
        lp, values, indices = ops.logprobs_of(rows, want, kmax)
        wide = rows.to(torch.float32)
        picked = wide.gather(1, want.unsqueeze(1))
        ranks.extend((1 + (wide > picked).sum(dim=1)).tolist())
        chosen.extend(lp.tolist())
        if values is not None and indices is not None:
            top_v.extend(values.tolist())
            top_i.extend(indices.tolist())
    out: list[TokenLogprob] = []
    for j, token in enumerate(flat_targets):
        k = k_of[j]
        top = tuple(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else ()
        out.append(TokenLogprob(token, chosen[j], top, ranks[j]))
    groups: list[list[TokenLogprob]] = []
    at = 0
    for group in targets:
        groups.append(out[at : at + len(group)])
        at += len(group)
    return groups
