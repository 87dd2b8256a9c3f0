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

__all__ = ["ROOT_KEY", "PrefixIndex", "chain_key"]

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


class _Entry:
    __slots__ = ("children", "page", "parent", "stamp")

    def __init__(self, page: int, parent: bytes | None, stamp: int) -> None:
        self.page = page
        self.parent = parent
        self.children = 0
        self.stamp = stamp


class PrefixIndex:
    """key -> page, with parent links, child counts and a logical LRU clock.

    Not locked itself: every call is made under the KV manager's lock.
    """

    def __init__(self, arena: PageArena) -> None:
        self._arena = arena
        self._entries: dict[bytes, _Entry] = {}
        self._page_keys: dict[int, bytes] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def pages(self) -> list[int]:
        """Every page the index holds a reference on."""
        return list(self._page_keys)

    def num_idle(self) -> int:
        """Indexed pages no request holds (the index is their only owner): cached, not in use."""
        owners = self._arena.owners
        return sum(1 for p in self._page_keys if owners[p] == 1)

    def holds(self, page: int) -> bool:
        return page in self._page_keys

    def get(self, key: bytes) -> int | None:
        """The page keyed ``key`` (re-stamping it as recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._clock += 1
        entry.stamp = self._clock
        return entry.page

    def insert(self, key: bytes, page: int, parent: bytes | None) -> bool:
        """Index ``page`` under ``key`` and take an owner reference on it.

        The first writer wins (an existing key keeps its page). A page whose parent is no longer
        indexed is not inserted: it would be unreachable, since lookups walk from the root.
        """
        entries = self._entries
        if key in entries or page in self._page_keys:
            return False
        parent_entry = None
        if parent is not None:
            parent_entry = entries.get(parent)
            if parent_entry is None:
                return False
        self._clock += 1
        entries[key] = _Entry(page, parent, self._clock)
        self._page_keys[page] = key
        if parent_entry is not None:
            parent_entry.children += 1
        self._arena.retain((page,))
        return True

    def num_evictable(self) -> int:
        """Pages eviction could free now (index-only pages whose subtree is index-only too)."""
        owners = self._arena.owners
        entries = self._entries
        blocked: set[bytes] = set()
        for key, entry in entries.items():
            if owners[entry.page] != 1:
                # This page is shared, so it and every ancestor stay.
                k: bytes | None = key
                while k is not None and k not in blocked:
                    blocked.add(k)
                    parent_entry = entries.get(k)
                    k = None if parent_entry is None else parent_entry.parent
        return len(entries) - len(blocked)

    def evict(self, n: int) -> int:
        """Free up to ``n`` pages, oldest evictable leaf first; returns pages freed."""
        if n <= 0 or not self._entries:
            return 0
        owners = self._arena.owners
        entries = self._entries
        heap = [
            (e.stamp, key) for key, e in entries.items() if e.children == 0 and owners[e.page] == 1
        ]
        heapq.heapify(heap)
        dropped: list[int] = []
        while heap and len(dropped) < n:
            _, key = heapq.heappop(heap)
            entry = entries.pop(key)
            del self._page_keys[entry.page]
            dropped.append(entry.page)
            if entry.parent is not None:
                parent_entry = entries.get(entry.parent)
                if parent_entry is not None:
                    parent_entry.children -= 1
                    if parent_entry.children == 0 and owners[parent_entry.page] == 1:
                        heapq.heappush(heap, (parent_entry.stamp, entry.parent))
        return self._arena.release(dropped)
