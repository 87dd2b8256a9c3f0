"""Page allocation: a locked FIFO free list, and the arena that counts owners per page.

The allocator has its own lock so that the size check and the takes are one atomic act (a plan
thread may allocate while the GPU thread frees). Owner counts live in the arena and are guarded
by the manager's lock; a page goes back to the free list only when its last owner lets go, which
is what makes read-only sharing (prefix index + streams) safe.

The arena also tells a watcher (the prefix index) when an *indexed* page gains or loses its last
owner besides the index, so the index keeps its idle count and eviction queue up to date instead
of walking every page to find them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Protocol

__all__ = ["SINK_PAGE", "OwnerWatcher", "PageAllocator", "PageArena", "PagesExhausted"]

#: Page id reserved as the write target of padding rows (when the config reserves one).
SINK_PAGE = 0


class PagesExhausted(RuntimeError):
    """`PageAllocator.allocate` could not take the pages asked for."""


class PageAllocator:
    """FIFO queue of free page ids behind one lock."""

    def __init__(self, num_pages: int, reserved: Iterable[int] = ()) -> None:
        skip = set(reserved)
        self.num_pages = num_pages
        self._free: deque[int] = deque(p for p in range(num_pages) if p not in skip)
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or None (taking nothing) when fewer are free."""
        if n <= 0:
            return []
        with self._lock:
            free = self._free
            if len(free) < n:
                return None
            take = free.popleft
            return [take() for _ in range(n)]

    def allocate(self, n: int) -> list[int]:
        pages = self.try_allocate(n)
        if pages is None:
            raise PagesExhausted(f"asked for {n} pages, {self.num_free} free")
        return pages

    def free(self, pages: Iterable[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    def free_pages(self) -> list[int]:
        """A snapshot of the free list (debug checks)."""
        with self._lock:
            return list(self._free)


class OwnerWatcher(Protocol):
    """Told when an indexed page's owners other than the index drop to zero or rise from it."""

    def page_idle(self, page: int) -> None: ...

    def page_busy(self, page: int) -> None: ...


class PageArena:
    """An allocator plus per-page owner counts; callers hold the manager lock.

    ``indexed[p]`` is 1 while the watcher (the prefix index) holds one of page ``p``'s owner
    references; for those pages a 2 -> 1 owner drop calls ``watcher.page_idle`` and a 1 -> 2
    rise calls ``watcher.page_busy``.
    """

    def __init__(self, num_pages: int, reserve_sink: bool) -> None:
        self.num_pages = num_pages
        self.sink_page: int | None = SINK_PAGE if reserve_sink else None
        reserved = () if self.sink_page is None else (self.sink_page,)
        self.allocator = PageAllocator(num_pages, reserved)
        self.owners: list[int] = [0] * num_pages
        if self.sink_page is not None:
            self.owners[self.sink_page] = 1
        self.num_usable = num_pages - len(reserved)
        self.indexed = bytearray(num_pages)
        self.watcher: OwnerWatcher | None = None

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def acquire(self, n: int) -> list[int] | None:
        """Take ``n`` fresh pages with one owner each, or None when short."""
        pages = self.allocator.try_allocate(n)
        if pages:
            owners = self.owners
            for p in pages:
                owners[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add one owner to each page; the sink page (a sliding group's `HOLE`) is skipped."""
        owners = self.owners
        indexed = self.indexed
        watcher = self.watcher
        sink = self.sink_page
        for p in pages:
            if p == sink:
                continue
            n = owners[p] = owners[p] + 1
            if n == 2 and indexed[p] and watcher is not None:
                watcher.page_busy(p)

    def release(self, pages: Iterable[int]) -> int:
        """Drop one owner of each page (the sink page skipped); returns how many pages went
        back to the free list."""
        owners = self.owners
        indexed = self.indexed
        watcher = self.watcher
        sink = self.sink_page
        freed = []
        for p in pages:
            if p == sink:
                continue
            n = owners[p] - 1
            if n < 0:
                raise AssertionError(f"page {p} released more times than it was owned")
            owners[p] = n
            if n == 0:
                freed.append(p)
            elif n == 1 and indexed[p] and watcher is not None:
                watcher.page_idle(p)
        if freed:
            self.allocator.free(freed)
        return len(freed)
