"""Small host values sent to the device without waiting for it.

`torch.tensor(values, device="cuda")` (and assigning a host tensor into a CUDA one) copies
synchronously: the host blocks until every kernel queued before the copy has run. The engine
plans the next step while the device runs the current forward, so one such copy in a plan makes
the host wait out the forward, and the host is never ahead of the device (on an H200 the
sampler's index tensors did that at every step). Page-locked staging makes the copy truly
asynchronous; torch's pinned-memory cache reuses a block only once the copy that read it ran.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`, the copy queued behind the device's work, not awaited."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
