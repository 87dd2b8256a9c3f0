"""Static tensors a captured CUDA graph reads: allocated once, grown only before capture."""

from __future__ import annotations

import torch

__all__ = ["GrowOnlyBuffers"]


class GrowOnlyBuffers:
    """Named static tensors that only ever grow, and never once their address was handed out.

    `build_cuda_graph_buffers` may be called once per capturing runner with different sizes: a
    smaller request keeps the existing tensor, a larger one reallocates. Once `get` has handed a
    view out (a plan wrote it, a graph may have recorded it) the buffer is pinned: growing it
    then raises instead of silently leaving a graph reading freed memory.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()

    def ensure(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        have = self._tensors.get(name)
        if have is not None and have.numel() >= size and have.dtype == dtype:
            return have
        if name in self._pinned:
            raise RuntimeError(
                f"static buffer {name!r} would grow to {size} after its address was handed out"
            )
        grown = torch.zeros(size, dtype=dtype, device=self.device)
        self._tensors[name] = grown
        return grown

    def size(self, name: str) -> int:
        """The buffer's entries (all of them: a caller that lays its own views out)."""
        return self._tensors[name].numel()

    def get(self, name: str, size: int) -> torch.Tensor:
        """The first ``size`` entries (a smaller bucket's view); pins the buffer."""
        have = self._tensors[name]
        if have.numel() < size:
            raise RuntimeError(f"static buffer {name!r} holds {have.numel()}, {size} asked")
        self._pinned.add(name)
        return have[:size]
