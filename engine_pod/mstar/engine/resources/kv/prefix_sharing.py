"""`PrefixSharing`: the KV cache's prefix reuse: matching a prompt against indexed pages, and
offering newly filled pages to the index at commit.

A mixin of `KVCacheResource`: it works on the cache's streams, arena, prefix index and lock.

On a hybrid model the other KV groups' pages are indexed under `group_key` of the main key at
the same position, and a hit is the longest main prefix for which every group has the pages
its next query reads (a sliding group: its window before the hit's end; as vLLM's
sliding-window manager looks for them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from mstar.engine.resources.kv.allocator import PageArena
from mstar.engine.resources.kv.groups import HOLE, live_from
from mstar.engine.resources.kv.prefix import ROOT_KEY, PrefixIndex, chain_key, group_key
from mstar.engine.resources.kv.stream import MAIN_LABEL, Stream

__all__ = ["PrefixSharing"]


class PrefixSharing:
    """`match_prefix` / `probe_prefix` / `evict_prefix_cache`, and the index's upkeep."""

    # The cache's state, set by `KVCacheResource.__init__`.
    page_size: int
    arena: PageArena
    prefix: PrefixIndex | None
    prefix_queries: int
    prefix_hits: int
    _linked: tuple[tuple[str, int], ...]
    _streams: dict[str, dict[str, Stream]]
    _tokens: dict[str, Sequence[int]]
    _roots: dict[str, bytes]
    _lock: threading.RLock
    _check: Callable[[], None]

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Reuse indexed pages for the request's prompt; returns the number of tokens reused.

        Whole pages only, at most ``len(token_ids) - 1`` tokens so at least one is computed.
        Call before the request's first admit: it sets the main stream's pages and stored
        length. Any later call (or a call on a stream that already holds state) changes nothing
        and answers the stream's stored length. Counts ``prefix_queries`` / ``prefix_hits`` in
        tokens, once per request.
        """
        ps = self.page_size
        with self._lock:
            per = self._streams.get(request_id)
            if per is None:
                raise KeyError(f"match_prefix: request {request_id!r} was never ingested")
            stream = per.setdefault(MAIN_LABEL, Stream())
            if stream.matched is not None or stream.pages or stream.stored_len or stream.offloaded:
                # Already matched or already holding state: the truthful answer is how many of
                # the request's tokens the cache holds; counted once, never re-matched.
                return stream.stored_len
            self.prefix_queries += len(token_ids)
            pages, keys = self._lookup_prefix(token_ids, self._roots.get(request_id, ROOT_KEY))
            fit, linked = self._fit_groups(keys)
            pages, keys = pages[:fit], keys[:fit]
            self.arena.retain(pages)
            stream.pages = pages
            stream.keys = keys
            stream.stored_len = matched = len(pages) * ps
            stream.matched = matched
            stream.generation += 1
            for label, live, group_pages in linked:
                other = per[label] = Stream()
                self.arena.retain(group_pages)
                other.pages = [HOLE] * live + group_pages
                other.dropped = live
                other.stored_len = matched
                other.generation += 1
            self.prefix_hits += matched
            self._check()
            return matched

    def probe_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens `match_prefix` would reuse now; takes nothing and counts nothing."""
        with self._lock:
            return self._fit_groups(self._lookup_prefix(token_ids)[1])[0] * self.page_size

    def _fit_groups(self, keys: list[bytes]) -> tuple[int, list[tuple[str, int, list[int]]]]:
        """How many of the main prefix's pages every other KV group can follow, and each
        group's (first live page, its indexed pages from there) at that length."""
        prefix = self.prefix
        if not self._linked or prefix is None or not keys:
            return len(keys), [(label, 0, []) for label, _ in self._linked]
        ps = self.page_size
        found: dict[str, list[int | None]] = {}
        runs: dict[str, list[int]] = {}
        for label, _ in self._linked:
            pages = found[label] = [prefix.peek(group_key(key, label)) for key in keys]
            run = runs[label] = []
            for i, page in enumerate(pages):
                run.append(0 if page is None else (run[i - 1] if i else 0) + 1)
        fit = len(keys)
        while fit and not all(
            runs[label][fit - 1] >= fit - live_from(fit * ps, window, ps)
            for label, window in self._linked
        ):
            fit -= 1
        out = []
        for label, window in self._linked:
            live = live_from(fit * ps, window, ps)
            out.append((label, live, [p for p in found[label][live:fit] if p is not None]))
        return fit, out

    def _lookup_prefix(
        self, token_ids: Sequence[int], root: bytes = ROOT_KEY
    ) -> tuple[list[int], list[bytes]]:
        """Indexed pages (and their keys) of the longest whole-page prefix, at most len - 1,
        on the chain from ``root`` (a request's `KVRequestConfig.cache_salt`)."""
        pages: list[int] = []
        keys: list[bytes] = []
        if self.prefix is None:
            return pages, keys
        ps = self.page_size
        parent = root
        for i in range(max(len(token_ids) - 1, 0) // ps):
            key = chain_key(parent, token_ids[i * ps : (i + 1) * ps])
            page = self.prefix.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def _index_pages(self, rid: str, stream: Stream) -> None:
        """Offer the stream's newly filled whole pages to the prefix index.

        Keys come from the request's live token list; pages the list does not cover yet wait
        for a later commit. Only the main stream is indexed (its tokens are the request's).
        """
        tokens = self._tokens.get(rid)
        prefix = self.prefix
        if tokens is None or prefix is None:
            return
        ps = self.page_size
        keys = stream.keys
        full = min(stream.stored_len, len(tokens)) // ps
        parent: bytes | None = keys[-1] if keys else None
        per = self._streams[rid]
        others = [(label, per[label].pages) for label, _ in self._linked if label in per]
        root = self._roots.get(rid, ROOT_KEY)
        for i in range(len(keys), full):
            key = chain_key(parent if parent is not None else root, tokens[i * ps : (i + 1) * ps])
            prefix.insert(key, stream.pages[i], parent)
            for label, pages in others:  # still held: commit indexes before a group slides
                if i < len(pages) and pages[i] != HOLE:
                    prefix.insert(group_key(key, label), pages[i], None)
            keys.append(key)
            parent = key

    def evict_prefix_cache(self, num_pages: int | None = None) -> int:
        """Evict LRU index leaves (all evictable ones by default); returns pages freed."""
        if self.prefix is None:
            return 0
        with self._lock:
            freed = self.prefix.evict(len(self.prefix) if num_pages is None else num_pages)
            self._check()
            return freed
