"""`GroupedStreams`: a request's streams across the KV groups of a hybrid model (`KVGroups`).

A mixin of `KVCacheResource`: steps declare the main stream only and every stage applies a
main segment to the other groups too; a sliding group gives its pages back at commit once no
query reads them again (`HOLE`s in its page list).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from mstar.engine.resources.kv.allocator import PageArena
from mstar.engine.resources.kv.config import pages_for
from mstar.engine.resources.kv.groups import HOLE, MAIN_LABEL, KVGroups
from mstar.engine.resources.kv.stream import Stream
from mstar.engine.resources.step import Segment

__all__ = ["GroupedStreams"]


class GroupedStreams:
    """Streams per KV group: creation, segment expansion, sliding, per-group counts."""

    # The cache's state, set by `KVCacheResource.__init__`.
    page_size: int
    arena: PageArena
    groups: KVGroups
    _linked: tuple[tuple[str, int], ...]
    _streams: dict[str, dict[str, Stream]]
    _lock: threading.RLock

    def pages_by_label(self) -> dict[str, int]:
        """Distinct device pages the requests' streams hold, per KV group (walks the streams:
        /metrics, tests)."""
        held: dict[str, set[int]] = {label: set() for label in self.groups.labels}
        with self._lock:
            for per in self._streams.values():
                for label, stream in per.items():
                    held.setdefault(label, set()).update(stream.pages[stream.dropped :])
        return {label: len(pages) for label, pages in held.items()}

    def pages_to_grow(self, request_id: str, num_tokens: int) -> int:
        """New pages an admit takes for the request to hold ``num_tokens`` tokens in all."""
        need = pages_for(num_tokens, self.page_size)
        with self._lock:
            per = self._streams.get(request_id) or {}
            held = [len(s.pages) for s in per.values()]
        return sum(max(0, need - h) for h in held) + need * (len(self.groups.labels) - len(held))

    def _new_streams(self) -> dict[str, Stream]:
        return {label: Stream() for label in self.groups.labels}

    def _expand(self, segments: Sequence[Segment]) -> Sequence[Segment]:
        """The segments with each main one repeated for the request's other KV groups."""
        if not self._linked:
            return segments
        out: list[Segment] = []
        for seg in segments:
            out.append(seg)
            if seg[1] == MAIN_LABEL:
                out.extend(Segment(seg[0], label, seg[2]) for label, _ in self._linked)
        return out

    def _slide(self, stream: Stream, live: int) -> None:
        """Give back a sliding group's pages before ``live``: no query reads them again."""
        gone = stream.pages[stream.dropped : live]
        self.arena.release(gone)
        stream.pages[stream.dropped : live] = [HOLE] * len(gone)
        stream.dropped = live
        stream.generation += 1
