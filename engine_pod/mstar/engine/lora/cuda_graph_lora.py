"""LoRA inside the captured CUDA decode graph (issue 49).

A graph records tensor addresses, so everything a replay reads lives in tensors made once:

- the adapters' weights: every `LoraSlice`'s ``a`` [S, R, in], ``b`` [S, R, n] and ``scales``
  [S] (on the decoder's device) are allocated for ``--max-loras`` slots up front, and a load or
  an eviction copies into its slot (`LoraSlice.write`), never reallocating;
- each row's slot: `GraphLoraRows` holds one [max_bs] int64 buffer per graph slot (the same
  two slots the graph runner rotates), which the runner fills before a replay: the step's rows'
  adapter slots, -1 for base rows and padding rows.

The update is computed with no gather and no host read (`lora_add_masked`): shrink every row
against every slot's A stacked as one [S*R, in] matrix, zero the slots a row does not use and
scale the one it does, expand with every slot's B stacked as [S*R, n]. Two dense GEMMs whose
shapes depend only on the bucket. Punica's bgmv (vLLM's ``lora_shrink``/``lora_expand``) instead
reads each row's own A/B through the row's index in a custom kernel; the dense form spends
``max_loras`` times the shrink's flops (S*R columns against the base projection's n) so that
plain cuBLAS GEMMs replay in the graph, which a decode step, bound by reading the weights, hides.
A slot being written by a load while a replay reads it is multiplied by a zero weight: its
values (zeros, or the new adapter's finite weights) add nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mstar.engine.lora.resource import LoraPlan
from mstar.engine.resources.host_copy import to_device


def lora_add_masked(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    col_off: int,
) -> None:
    """``y[:, off:off+n] += scale[s] * (x A[s]^T) B[s]`` with ``s = row_slots[t]`` (-1: nothing)
    for every row at once: x [T, in], a [S, R, in], b [S, R, n], scales [S] float32 and
    row_slots [T] int64 on x's device; fixed shapes, no host sync (graph-capturable)."""
    num_slots, rank, n = b.shape
    shrink = x @ a.reshape(num_slots * rank, -1).t()  # [T, S*R]
    chosen = row_slots.unsqueeze(1) == torch.arange(num_slots, device=x.device)
    weight = torch.where(chosen, scales.unsqueeze(0), 0.0)  # [T, S] float32
    v = shrink.float().view(-1, num_slots, rank) * weight.unsqueeze(-1)
    y[:, col_off : col_off + n] += v.to(x.dtype).view(-1, num_slots * rank) @ b.reshape(-1, n)


def row_slots(plan: LoraPlan | None, rows: int) -> list[int]:
    """Each of a step's ``rows`` rows' adapter slot, from its segments (-1: the base model, and
    every row past the plan's: a graph bucket's padding)."""
    slots: list[int] = []
    if plan is not None:
        slots = [s for n, s in zip(plan.lengths, plan.slots, strict=True) for _ in range(n)]
    if len(slots) > rows:
        raise ValueError(f"{len(slots)} LoRA rows planned for a step of {rows}")
    return slots + [-1] * (rows - len(slots))


class GraphLoraRows:
    """Per graph slot, the rows' adapter slots a captured decode forward reads ([max_bs] int64,
    -1 filled), and the one bound while a forward is captured or run as the graph's eager twin
    (`bound`): `LoraLinear` then adds its update with `lora_add_masked` over it."""

    def __init__(self, num_slots: int, max_bs: int, device: torch.device) -> None:
        self.device = device
        self.buffers = [
            torch.full((max_bs,), -1, dtype=torch.long, device=device) for _ in range(num_slots)
        ]
        #: the rows' slots of the forward being recorded (or run eager): None outside one
        self.current: torch.Tensor | None = None
        #: steps staged (how tests see that graph steps took this path)
        self.staged = 0

    @contextmanager
    def bound(self, slot: int, bs: int) -> Iterator[None]:
        """Around the static forward of (bucket ``bs``, graph slot ``slot``)."""
        self.current = self.buffers[slot][:bs]
        try:
            yield
        finally:
            self.current = None

    def stage(self, slot: int, bs: int, plan: LoraPlan | None) -> None:
        """Write a step's rows' adapter slots into graph slot ``slot``'s buffer before its
        replay, queued on the current stream behind the previous replays (not awaited)."""
        staged = to_device(row_slots(plan, bs), torch.long, self.device)
        self.buffers[slot][:bs].copy_(staged, non_blocking=True)
        self.staged += 1
