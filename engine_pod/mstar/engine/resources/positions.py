"""Positions resource: the absolute position of every token in the step, read from KV's plan.

Each segment's tokens continue its stream, so token j of row i sits at ``prefix_lens[i] + j``.
The decode fast path (one token per row) is the prefix lengths themselves; mixed batches are one
vectorised expression, never a per-request loop.

Under a slot lease with a CUDA-graph bucket the positions go into that slot's static buffer,
padded with position 0 to the bucket's batch size: the address the graph recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv.plan import KVPlan
from mstar.engine.resources.static_buffers import GrowOnlyBuffers
from mstar.engine.resources.step import ResourceStep, SlotLease, StepContext


def pad_positions(prefix_lens: torch.Tensor, bs: int) -> torch.Tensor:
    """Decode positions (each row's prefix length) padded with position 0 up to ``bs``."""
    pad = torch.zeros(bs - prefix_lens.shape[0], dtype=torch.int64)
    return torch.cat([prefix_lens.to("cpu", torch.int64), pad])


class PositionsResource(Resource):
    """Plans a LongTensor [num_tokens] of positions on the model's device; RoPE reads it."""

    def __init__(self, device: torch.device | str = "cpu", kv_key: str = "kv") -> None:
        self.device = torch.device(device)
        self.kv_key = kv_key
        self._slot_buffers: dict[int, GrowOnlyBuffers] = {}

    def depends_on(self) -> set[str]:
        return {self.kv_key}

    def build_cuda_graph_buffers(
        self, slots: Sequence[SlotLease], max_bs: int, max_seq_len: int
    ) -> None:
        for spec in slots:
            bufs = self._slot_buffers.setdefault(spec.slot, GrowOnlyBuffers(self.device))
            bufs.ensure("positions", max_bs, torch.int64)

    def plan(self, step: ResourceStep, ctx: StepContext) -> torch.Tensor:
        kv: KVPlan = ctx.plan_results[self.kv_key]
        lease = ctx.slot_lease
        if lease is not None and lease.bucket is not None:
            bs = lease.bucket.bs
            static = self._slot_buffers[lease.slot].get("positions", bs)
            static.copy_(pad_positions(kv.prefix_lens, bs), non_blocking=True)
            return static
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
