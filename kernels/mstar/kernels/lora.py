"""Batched LoRA over a step's rows: ``y[:, off:off+n] += scale[s] * (x A[s]^T) B[s]`` where
``s`` is each row's adapter slot (-1: the base model, nothing added), Punica-style (shrink to
the rank, then expand), with no Python loop over the batch.

Rows come in segments (one request's tokens are consecutive, and the step merges neighbours of
one slot): ``seg_indptr`` [G+1] and ``seg_slot`` [G] (int64, on the host). Weights per slot:
``a`` [S, R, in] and ``b`` [S, R, n] (B transposed, so the expand reads rows), ``ranks`` [S]
(int64: rows of A/B in use, 0 where the slot's adapter leaves this projection alone) and
``scales`` [S] (float32, alpha / r).

- CPU with the C++ kernels (float32 or bf16): ``lora_add_``, one task per row block, the shrink
  and the expand in float32 registers over the slot's first ``rank`` rows only.
- Elsewhere (CUDA, or no kernels): gathered batched matmuls over a per-row slot index on the
  device (`token_slots`), with no host sync: the form a captured graph can replay.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = (torch.float32, torch.bfloat16)


def token_slots(
    seg_indptr: torch.Tensor, seg_slot: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Each row's slot [T] (int64, -1 for the base) on ``device``."""
    lengths = seg_indptr[1:] - seg_indptr[:-1]
    return torch.repeat_interleave(seg_slot, lengths).to(device)


def lora_add_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    col_off: int,
) -> None:
    """The gathered form: rows' A and B gathered by ``slots`` [T] (weights past a slot's rank
    are zero, so the padded rank adds nothing)."""
    index = slots.clamp(min=0)
    scale = torch.where(slots >= 0, scales.to(x.device)[index], 0.0).to(torch.float32)
    v = torch.bmm(a[index].float(), x.float().unsqueeze(-1)).squeeze(-1) * scale[:, None]
    out = torch.bmm(v.unsqueeze(1), b[index].float()).squeeze(1)
    n = b.shape[-1]
    y[:, col_off : col_off + n] += out.to(y.dtype)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slot: torch.Tensor,
    col_off: int,
    *,
    kernels: Any | None = None,
    slots: torch.Tensor | None = None,
) -> None:
    """Add the rows' LoRA updates into ``y`` (C++ where it runs, else `lora_add_torch` over
    ``slots``, computed here when not given)."""
    if kernels is not None and x.device.type == "cpu" and x.dtype in DTYPES:
        kernels.lora_add_(y, x, a, b, ranks, scales, seg_indptr, seg_slot, col_off)
        return
    if slots is None:
        slots = token_slots(seg_indptr, seg_slot, x.device)
    lora_add_torch(y, x, a, b, scales, slots, col_off)
