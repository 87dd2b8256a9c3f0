"""The host page pool: where offloaded streams' pages wait until reload."""

from __future__ import annotations

import torch

from mstar.engine.resources.kv.allocator import PageAllocator
from mstar.engine.resources.kv.cache import KVCache

__all__ = ["HostPagePool"]


class HostPagePool:
    """A host tensor shaped like the device cache, with its own allocator.

    Pinned when the device is CUDA so device<->host copies are real DMA transfers.
    """

    def __init__(self, cache: KVCache, num_pages: int) -> None:
        shape = list(cache.tensor.shape)
        shape[1] = num_pages
        tensor = torch.zeros(shape, dtype=cache.tensor.dtype, device="cpu")
        if cache.device.type == "cuda":
            tensor = tensor.pin_memory()
        self.tensor = tensor
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self._cache = cache

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.allocator.num_free

    def store(self, device_pages: list[int]) -> list[int] | None:
        """Copy device pages into fresh host pages; None (copying nothing) when short."""
        host_pages = self.allocator.try_allocate(len(device_pages))
        if host_pages is None or not host_pages:
            return host_pages
        data = self._cache.gather_pages(device_pages).to("cpu")
        index = torch.tensor(host_pages, dtype=torch.long)
        self.tensor.index_copy_(1, index, data)
        return host_pages

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages back into the given device pages (same order)."""
        if not host_pages:
            return
        index = torch.tensor(host_pages, dtype=torch.long)
        self._cache.scatter_pages(device_pages, self.tensor.index_select(1, index))
        if self._cache.device.type == "cuda":
            torch.cuda.current_stream(self._cache.device).synchronize()

    def free(self, host_pages: list[int]) -> None:
        if host_pages:
            self.allocator.free(host_pages)
