"""Positions resource: the absolute position of every token in the step, read from KV's plan.

Each segment's tokens continue its stream, so token j of row i sits at ``prefix_lens[i] + j``.
The decode fast path (one token per row) is the prefix lengths themselves; mixed batches are one
vectorised expression, never a per-request loop.
"""

from __future__ import annotations

import torch

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv.plan import KVPlan
from mstar.engine.resources.step import ResourceStep, StepContext


class PositionsResource(Resource):
    """Plans a LongTensor [num_tokens] of positions on the model's device; RoPE reads it."""

    def __init__(self, device: torch.device | str = "cpu", kv_key: str = "kv") -> None:
        self.device = torch.device(device)
        self.kv_key = kv_key

    def depends_on(self) -> set[str]:
        return {self.kv_key}

    def plan(self, step: ResourceStep, ctx: StepContext) -> torch.Tensor:
        kv: KVPlan = ctx.plan_results[self.kv_key]
        prefix = kv.prefix_lens.to(torch.int64)
        if kv.is_decode:
            positions = prefix
        else:
            starts = kv.qo_indptr[:-1].to(torch.int64)
            spans = kv.qo_indptr[1:].to(torch.int64) - starts
            # token t of row i: t - starts[i] + prefix[i]
            offsets = torch.repeat_interleave(prefix - starts, spans, output_size=kv.num_tokens)
            positions = torch.arange(kv.num_tokens, dtype=torch.int64) + offsets
        return positions.to(self.device, non_blocking=True)
