"""`KVCapacity`: the one view of the KV cache the scheduler holds.

The scheduler asks it how much room there is, how many pages a request needs, and whether a
copy is still moving; it reuses a prompt's cached prefix through it. Every change of a request's
KV state beyond that (offload, reload, reset, removal) goes through the `StepRunner`, which
scopes it to the resource that refused. So the scheduler never reaches into streams, the arena
or the prefix index.
"""

from __future__ import annotations

from collections.abc import Sequence

from mstar.engine.resources.kv.config import pages_for
from mstar.engine.resources.kv.manager import KVCacheResource

__all__ = ["KVCapacity"]


class KVCapacity:
    """Capacity and prefix questions about one `KVCacheResource`, answered in pages."""

    def __init__(self, kv: KVCacheResource) -> None:
        self._kv = kv
        self.page_size = kv.page_size
        #: Usable device pages (the sink page excluded).
        self.num_pages = kv.num_pages

    def room(self) -> int:
        """Pages an admission can take now: free ones plus idle prefix-cache pages."""
        return self._kv.num_free_pages + self._kv.num_cached_pages

    def pages_in_transit(self) -> int:
        """Device pages in-flight copies give back when they land."""
        return self._kv.num_pages_in_transit

    def pages_for(self, num_tokens: int) -> int:
        """Pages a request holding ``num_tokens`` tokens keeps, over every KV group (a
        sliding group: its window's)."""
        return self._kv.groups.live_pages(num_tokens, self.page_size)

    def pages_to_grow(self, request_id: str, num_tokens: int) -> int:
        """New pages the request needs to hold ``num_tokens`` tokens in all."""
        return self._kv.pages_to_grow(request_id, num_tokens)

    def pages_to_admit(self, token_ids: Sequence[int]) -> int:
        """New pages a request holding nothing needs for ``token_ids`` in one step, after the
        prefix it would reuse now (probed: nothing is taken or counted). A sliding group holds
        every page of a step until its commit, so this is an upper bound when prefill is
        chunked."""
        kv = self._kv
        cached = kv.probe_prefix(token_ids) if kv.prefix is not None else 0
        groups = len(kv.groups.labels)
        return groups * (pages_for(len(token_ids), self.page_size) - cached // self.page_size)

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Reuse cached prefix pages for a request about to prefill; tokens reused (0 without
        a prefix cache, where nothing is looked up or counted)."""
        kv = self._kv
        return kv.match_prefix(request_id, token_ids) if kv.prefix is not None else 0

    def holds_pages(self, request_id: str) -> bool:
        return self._kv.pages_held_by(request_id) > 0

    def stored_len(self, request_id: str) -> int:
        """Tokens of the request the cache holds (what a commit or a reset leaves)."""
        return self._kv.stored_len(request_id)

    def copy_in_flight(self, request_id: str) -> bool:
        """An offload or reload of the request has been claimed and has not landed yet."""
        return self._kv.copy_in_flight(request_id)

    def wait_copy_progress(self, timeout: float) -> bool:
        """Block until an in-flight copy lands or ``timeout`` passes; at once, answering False,
        with none in flight."""
        return self._kv.wait_copy_progress(timeout)
