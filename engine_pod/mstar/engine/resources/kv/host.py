"""The host page pool: where offloaded streams' pages wait until reload, and the copies to it.

The host tensor is page-major, ``[pages, layers, 2, page_size, kv_heads, head_dim]``, so one host
page (all layers, K and V) is one contiguous block: on CUDA a run of consecutive host pages is a
single DMA straight into (or out of) pinned memory, never through a pageable staging buffer.
It is allocated once, uninitialised (every host page is written before it is read), and pinned
at allocation on CUDA.

On CUDA the copies run on a dedicated copy stream. `mark_ready()` records an event on the
caller's current stream when a copy is claimed; the copy stream waits on it, so an offload reads
pages only after the forwards that wrote them, and a reload writes pages only after the work
queued on them by their previous owner. `copy_out` / `copy_in` block the calling thread (the copy
worker) until the transfer is done, so the pages may be released or read the moment they return.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mstar.engine.resources.kv.allocator import PageAllocator
from mstar.engine.resources.kv.cache import KVCache

__all__ = ["HostPagePool"]

#: Pages moved per device-side gather/scatter: bounds the device scratch of one copy.
COPY_CHUNK_PAGES = 64


def _runs(pages: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(offset, first, count)`` for each run of consecutive ids in ``pages``."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield start, pages[start], i - start
            start = i


class HostPagePool:
    """A page-major host tensor shaped like the device cache, with its own allocator."""

    def __init__(self, cache: KVCache, num_pages: int) -> None:
        layers, _, kv, page_size, heads, dim = cache.tensor.shape
        cuda = cache.device.type == "cuda"
        self.tensor = torch.empty(
            (num_pages, layers, kv, page_size, heads, dim),
            dtype=cache.tensor.dtype,
            device="cpu",
            pin_memory=cuda,
        )
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self._cache = cache
        self._stream = torch.cuda.Stream(cache.device) if cuda else None

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.allocator.num_free

    def reserve(self, n: int) -> list[int] | None:
        """Take ``n`` host pages, or None (taking nothing) when short."""
        return self.allocator.try_allocate(n)

    def free(self, host_pages: list[int]) -> None:
        if host_pages:
            self.allocator.free(host_pages)

    def mark_ready(self) -> torch.cuda.Event | None:
        """On CUDA, an event on the caller's stream that a later copy must wait for."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._cache.device))
        return event

    def copy_out(
        self, device_pages: list[int], host_pages: list[int], ready: torch.cuda.Event | None
    ) -> None:
        """Copy device pages into host pages (same order); returns once the bytes are there."""
        if not device_pages:
            return
        cache = self._cache
        if self._stream is None:
            index = torch.tensor(host_pages, dtype=torch.long)
            self.tensor.index_copy_(0, index, cache.gather_pages(device_pages).transpose(0, 1))
            return
        stream = self._stream
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for lo in range(0, len(device_pages), COPY_CHUNK_PAGES):
                chunk = host_pages[lo : lo + COPY_CHUNK_PAGES]
                # Page-major and contiguous on the device, so each host run is one DMA.
                data = cache.gather_pages(device_pages[lo : lo + len(chunk)])
                data = data.transpose(0, 1).contiguous()
                for offset, first, count in _runs(chunk):
                    self.tensor[first : first + count].copy_(
                        data[offset : offset + count], non_blocking=True
                    )
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def copy_in(
        self, host_pages: list[int], device_pages: list[int], ready: torch.cuda.Event | None
    ) -> None:
        """Copy host pages back into the given device pages (same order), blocking until done."""
        if not host_pages:
            return
        cache = self._cache
        if self._stream is None:
            index = torch.tensor(host_pages, dtype=torch.long)
            cache.scatter_pages(device_pages, self.tensor.index_select(0, index).transpose(0, 1))
            return
        stream = self._stream
        page_shape = self.tensor.shape[1:]
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for lo in range(0, len(host_pages), COPY_CHUNK_PAGES):
                chunk = host_pages[lo : lo + COPY_CHUNK_PAGES]
                data = torch.empty(
                    (len(chunk), *page_shape), dtype=self.tensor.dtype, device=cache.device
                )
                for offset, first, count in _runs(chunk):
                    data[offset : offset + count].copy_(
                        self.tensor[first : first + count], non_blocking=True
                    )
                cache.scatter_pages(device_pages[lo : lo + len(chunk)], data.transpose(0, 1))
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
