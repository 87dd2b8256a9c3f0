"""Records of in-flight host<->device copies, and the ledger that says which are in flight.

A `Copy` is one request's offload or reload between its claim and its landing. While it is in
flight the streams it moves hold the pages it reads and writes. If the request is removed (or
reset) meanwhile, the copy is *detached*: its streams leave the manager but stay referenced here
as an orphan, and every page they hold is released when the copy finishes, never earlier, so no
page is handed to anyone else while a copy still touches it.

Not locked itself: every call is made under the KV manager's lock.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mstar.engine.resources.kv.stream import Stream

__all__ = ["Copy", "CopyLedger", "Move"]


class Move:
    """One stream's part of a copy: the pages it moves and the generation it was claimed at."""

    __slots__ = ("device_pages", "generation", "host_pages", "stream")

    def __init__(self, stream: Stream, device_pages: list[int], host_pages: list[int]) -> None:
        self.stream = stream
        self.generation = stream.generation
        self.device_pages = device_pages
        self.host_pages = host_pages


class Copy:
    """A request's claimed offload (``offload=True``) or reload, until it lands."""

    __slots__ = ("detached", "in_transit", "moves", "offload", "ready", "request_id")

    def __init__(
        self,
        request_id: str,
        offload: bool,
        moves: list[Move],
        in_transit: int,
        ready: torch.cuda.Event | None,
    ) -> None:
        self.request_id = request_id
        self.offload = offload
        self.moves = moves
        #: Device pages that return to the pool (free, or idle in the prefix index) on landing.
        self.in_transit = in_transit
        #: On CUDA, the event the copy stream waits on before touching the pages.
        self.ready = ready
        #: The request was removed or reset mid-copy: the landing releases every page.
        self.detached = False

    def device_pages(self) -> list[int]:
        return [p for m in self.moves for p in m.device_pages]

    def host_pages(self) -> list[int]:
        return [p for m in self.moves for p in m.host_pages]


class CopyLedger:
    """In-flight copies: attached ones by request id, detached ones until they land."""

    def __init__(self) -> None:
        self._attached: dict[str, Copy] = {}
        self._orphans: list[Copy] = []
        #: Sum of `Copy.in_transit` over every copy in flight (attached or detached).
        self.num_pages_in_transit = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._attached

    def get(self, request_id: str) -> Copy | None:
        return self._attached.get(request_id)

    def add(self, copy: Copy) -> None:
        assert copy.request_id not in self._attached, "one copy per request at a time"
        self._attached[copy.request_id] = copy
        self.num_pages_in_transit += copy.in_transit

    def detach(self, request_id: str) -> Copy | None:
        """The request is going away mid-copy; its copy (if any) becomes an orphan."""
        copy = self._attached.pop(request_id, None)
        if copy is None:
            return None
        copy.detached = True
        if not copy.offload:
            # A reload's fresh, private device pages come back once the copy lets go of them.
            extra = len(copy.device_pages())
            copy.in_transit += extra
            self.num_pages_in_transit += extra
        self._orphans.append(copy)
        return copy

    def finish(self, copy: Copy) -> None:
        """The copy landed (or failed): it is no longer in flight."""
        if self._attached.get(copy.request_id) is copy:
            del self._attached[copy.request_id]
        else:
            self._orphans.remove(copy)
        self.num_pages_in_transit -= copy.in_transit

    def moving_streams(self) -> Iterator[Stream]:
        """Streams of attached copies (still the manager's)."""
        for copy in self._attached.values():
            for move in copy.moves:
                yield move.stream

    def orphaned_streams(self) -> Iterator[Stream]:
        """Streams of detached copies: no longer the manager's, their pages still held."""
        for copy in self._orphans:
            for move in copy.moves:
                yield move.stream

    def check_consistent(self) -> None:
        total = sum(c.in_transit for c in (*self._attached.values(), *self._orphans))
        if total != self.num_pages_in_transit:
            raise AssertionError(
                f"copies in flight carry {total} pages in transit, the ledger says "
                f"{self.num_pages_in_transit}"
            )
