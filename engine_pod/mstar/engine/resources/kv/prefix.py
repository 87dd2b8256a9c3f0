"""Cross-request prefix sharing: whole pages keyed by a hash chain over their token ids.

``key_i = H(key_{i-1} || tokens of page i)`` with ``key_{-1} = b""``, so a key names a page
*and everything before it*: two requests share page i only if they agree on every token up to
the end of that page. The index holds one owner reference on each page it maps, which keeps an
indexed page alive after its writer is gone and stops anyone else from freeing it. Eviction
takes least-recently-used *leaves* (no indexed child) whose only owner is the index, so a chain
is always dropped from its tail and the remainder stays reachable.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Sequence

from mstar.engine.resources.kv.allocator import PageArena

__all__ = ["ROOT_KEY", "PrefixIndex", "chain_key", "group_key"]

#: Parent key of a sequence's first page.
ROOT_KEY = b""


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding ``tokens`` that follows the page keyed ``parent``.

    A 128-bit BLAKE2b digest: a collision would silently serve another prompt's KV, so a
    cryptographic hash is worth its cost (one call per filled page, not per token).
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def group_key(key: bytes, label: str) -> bytes:
    """The key of another KV group's page at the position the main chain keys ``key``.

    Such pages are indexed as roots (no parent): the main key already names the whole prefix,
    and a sliding group keeps only its window, so each can be evicted alone, LRU.
    """
    return hashlib.blake2b(key, digest_size=16, person=label.encode()[:16]).digest()


class _Entry:
    __slots__ = ("children", "page", "parent", "queued", "stamp")

    def __init__(self, page: int, parent: bytes | None, stamp: int) -> None:
        self.page = page
        self.parent = parent
        self.children = 0
        self.stamp = stamp
        #: The stamp this entry was last pushed onto the leaf heap with (-1: not queued).
        self.queued = -1


class PrefixIndex:
    """key -> page, with parent links, child counts and a logical LRU clock.

    What the engine asks every step is kept up to date as it changes, never recomputed:

    - ``num_idle`` (indexed pages only the index owns) moves on the arena's owner hooks
      (`page_idle` / `page_busy`), on insert and on eviction;
    - a min-heap of ``(stamp, key)`` holds every idle leaf, so `evict` pops the oldest one in
      O(log n). An item goes stale when its entry is re-stamped, becomes busy, gains a child or
      leaves; stale items are skipped when they surface (an entry is re-queued when it is an
      idle leaf again), and dropped in one pass once they outnumber the entries.

    Not locked itself: every call is made under the KV manager's lock.
    """

    def __init__(self, arena: PageArena) -> None:
        self._arena = arena
        self._entries: dict[bytes, _Entry] = {}
        self._page_keys: dict[int, bytes] = {}
        self._clock = 0
        self._num_idle = 0
        self._leaves: list[tuple[int, bytes]] = []
        arena.watcher = self

    def __len__(self) -> int:
        return len(self._entries)

    def pages(self) -> list[int]:
        """Every page the index holds a reference on (debug checks; walks the index)."""
        return list(self._page_keys)

    def num_idle(self) -> int:
        """Indexed pages no request holds (the index is their only owner): cached, not in use."""
        return self._num_idle

    def holds(self, page: int) -> bool:
        return bool(self._arena.indexed[page])

    def get(self, key: bytes) -> int | None:
        """The page keyed ``key`` (re-stamping it as recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._clock += 1
        entry.stamp = self._clock
        return entry.page

    def peek(self, key: bytes) -> int | None:
        """The page keyed ``key``, or None; the LRU clock does not move (probes)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.page

    def insert(self, key: bytes, page: int, parent: bytes | None) -> bool:
        """Index ``page`` under ``key`` and take an owner reference on it.

        The first writer wins (an existing key keeps its page). A page whose parent is no longer
        indexed is not inserted: it would be unreachable, since lookups walk from the root.
        """
        entries = self._entries
        arena = self._arena
        if key in entries or arena.indexed[page]:
            return False
        parent_entry = None
        if parent is not None:
            parent_entry = entries.get(parent)
            if parent_entry is None:
                return False
        self._clock += 1
        entry = entries[key] = _Entry(page, parent, self._clock)
        self._page_keys[page] = key
        if parent_entry is not None:
            parent_entry.children += 1  # its heap item (if any) is now stale: not a leaf
        arena.retain((page,))
        arena.indexed[page] = 1
        if arena.owners[page] == 1:
            self._num_idle += 1
            self._queue(key, entry)
        return True

    def check_consistent(self) -> None:
        """Raise AssertionError unless the incremental state matches a full recount (debug)."""
        arena = self._arena
        owners = arena.owners
        idle = sum(1 for p in self._page_keys if owners[p] == 1)
        if idle != self._num_idle:
            raise AssertionError(f"prefix index counts {self._num_idle} idle pages, {idle} are")
        flagged = {p for p in range(arena.num_pages) if arena.indexed[p]}
        if flagged != set(self._page_keys):
            raise AssertionError("arena's indexed flags differ from the prefix index's pages")
        queued = set(self._leaves)
        for key, e in self._entries.items():
            if e.children == 0 and owners[e.page] == 1 and (e.queued, key) not in queued:
                raise AssertionError(f"idle leaf page {e.page} is not on the leaf heap")

    # -- arena hooks ---------------------------------------------------------------------------
    def page_idle(self, page: int) -> None:
        """The index just became the page's only owner."""
        self._num_idle += 1
        key = self._page_keys[page]
        entry = self._entries[key]
        if entry.children == 0:
            self._queue(key, entry)

    def page_busy(self, page: int) -> None:
        """A request took the page again; its heap item (if any) is skipped until it is idle."""
        self._num_idle -= 1

    # -- eviction ------------------------------------------------------------------------------
    def _queue(self, key: bytes, entry: _Entry) -> None:
        """Put an idle leaf on the heap under its current stamp (once per stamp)."""
        if entry.queued == entry.stamp:
            return
        entry.queued = entry.stamp
        leaves = self._leaves
        heapq.heappush(leaves, (entry.stamp, key))
        if len(leaves) > 2 * len(self._entries) + 64:
            self._drop_stale_items()

    def _drop_stale_items(self) -> None:
        """Rebuild the heap from the idle leaves: amortised over the stale pushes it clears."""
        owners = self._arena.owners
        leaves = []
        for key, entry in self._entries.items():
            if entry.children == 0 and owners[entry.page] == 1:
                entry.queued = entry.stamp
                leaves.append((entry.stamp, key))
            else:
                entry.queued = -1
        heapq.heapify(leaves)
        self._leaves = leaves

    def evict(self, n: int) -> int:
        """Free up to ``n`` pages, oldest idle leaf first; returns pages freed."""
        if n <= 0:
            return 0
        arena = self._arena
        owners = arena.owners
        entries = self._entries
        dropped: list[int] = []
        while self._leaves and len(dropped) < n:  # not cached: `_queue` may rebuild the heap
            stamp, key = heapq.heappop(self._leaves)
            entry = entries.get(key)
            if entry is None or entry.queued != stamp:
                continue  # an older incarnation of the key, or superseded by a later push
            entry.queued = -1
            if entry.children or owners[entry.page] != 1:
                continue  # not an idle leaf now: re-queued when it is one again
            if entry.stamp != stamp:
                self._queue(key, entry)  # re-stamped while idle: wait for its new turn
                continue
            del entries[key]
            del self._page_keys[entry.page]
            arena.indexed[entry.page] = 0
            self._num_idle -= 1
            dropped.append(entry.page)
            if entry.parent is not None:
                parent_entry = entries.get(entry.parent)
                if parent_entry is not None:
                    parent_entry.children -= 1
                    if parent_entry.children == 0 and owners[parent_entry.page] == 1:
                        self._queue(entry.parent, parent_entry)
        return arena.release(dropped)
