"""One (request_id, label) KV sequence."""

from __future__ import annotations

from mstar.engine.resources.kv.groups import MAIN_LABEL

__all__ = ["MAIN_LABEL", "Stream"]


class Stream:
    """Pages and length of one stream.

    ``pages`` is a high-water mark: it may hold more pages than ``stored_len`` needs (an admit
    reserved them for a step that was refused elsewhere, or a shrink kept them), and plans slice
    it to the logical length. ``keys`` are the prefix-chain keys of its first ``len(keys)``
    pages (those already offered to the prefix index). ``matched`` is the answer of the
    request's `match_prefix` call (None until then), so it is matched and counted once.

    ``offloaded`` is True from the moment an offload claims the stream until a reload lands:
    while a copy is in flight both ``pages`` (being read, or being written by a reload) and
    ``host_pages`` are held. ``generation`` moves whenever the stream's pages or length change,
    so an offload that lands can tell whether the bytes it copied are still the stream's.

    ``dropped``: leading pages a sliding group gave back (`HOLE` entries in ``pages``; an
    offload copies and a reload restores only the pages after them).
    """

    __slots__ = (
        "dropped",
        "generation",
        "host_pages",
        "keys",
        "matched",
        "offloaded",
        "pages",
        "step_in_flight",
        "stored_len",
    )

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.stored_len = 0
        self.step_in_flight = False
        self.offloaded = False
        self.host_pages: list[int] = []
        self.keys: list[bytes] = []
        self.matched: int | None = None
        self.generation = 0
        self.dropped = 0
