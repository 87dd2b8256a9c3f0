"""What bounds a request: the waiting-queue bound (`Admission`) and its deadline (`Deadline`).

A full queue answers 429 before the body is read, parsed or tokenized, so a refusal costs the
server next to nothing. That is not enough against clients that ignore `Retry-After` (guidellm's
throughput profile: 512 of them posting back to back): answered at once, they come straight
back, the event loop spins on refusals and the engine thread, which needs the GIL between its
kernels, starves: completed throughput fell to 0 (`bench/bench_overload.py`). So once refusals
come faster than `FLOOD_REFUSALS_PER_SECOND`, a request that finds the queue full first waits up
to `ROOM_WAIT_SECONDS` for room (admitted as soon as a request ends) before its 429: a flood is
held at the door, at the cost of a timer each, and occasional refusals stay immediate.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mstar.engine.server.errors import APIError, bad_request

#: What a 429 (at capacity) or a 503 (draining) tells the client to wait before retrying.
RETRY_AFTER_SECONDS = 1
#: Refusals within one second past which a flood is held at the door.
FLOOD_REFUSALS_PER_SECOND = 64
#: How long a request arriving during a flood waits for room before its 429.
ROOM_WAIT_SECONDS = float(RETRY_AFTER_SECONDS)


class Admission:
    """The waiting-queue bound: room checks, 429s, and the wait for room during a flood."""

    def __init__(self, limit: int, num_waiting: Callable[[], int]) -> None:
        self.limit = limit
        self._num_waiting = num_waiting
        #: Requests waiting for room, oldest first.
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._window = time.monotonic()
        self._refusals = 0

    def has_room(self, requests: int = 1) -> bool:
        return self._num_waiting() + requests <= self.limit

    def refuse(self) -> APIError:
        """The 429 of a full queue (counted: many per second make a flood)."""
        self._count_refusal()
        return APIError(
            429,
            f"The server is at capacity ({self.limit} waiting requests); retry later.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    def _count_refusal(self) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._refusals = now, 0
        self._refusals += 1

    def flooded(self) -> bool:
        return time.monotonic() - self._window < 1.0 and self._refusals >= FLOOD_REFUSALS_PER_SECOND

    def room_freed(self) -> None:
        """A request ended: the oldest waiter looks for room."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait_for_room(self) -> bool:
        """True when the queue has room now, or (during a flood) gets some within
        `ROOM_WAIT_SECONDS`. A woken waiter that finds none yet (the engine admits its next
        request on its next step) keeps its place at the front."""
        if self.has_room():
            return True
        if not self.flooded():
            return False
        loop = asyncio.get_running_loop()
        end = loop.time() + ROOM_WAIT_SECONDS
        first = True
        while True:
            waiter = loop.create_future()
            if first:
                self._waiters.append(waiter)
            else:
                self._waiters.appendleft(waiter)
            first = False
            try:
                async with asyncio.timeout_at(end):
                    await waiter
            except TimeoutError:
                return self.has_room()
            if self.has_room():
                return True


class Deadline:
    """A request's deadline: the server's bound from arrival, which a body's `timeout`
    (seconds) may shorten, never lengthen. `at` is on the event loop's clock."""

    def __init__(self, arrival: float, seconds: float | None) -> None:
        self.arrival = arrival
        self.seconds = seconds
        self.at: float | None = None
        self.passed = False
        self._place()

    def _place(self) -> None:
        if self.seconds is None:
            return
        loop = asyncio.get_running_loop()
        self.at = loop.time() + self.seconds - (time.monotonic() - self.arrival)

    def shorten(self, body: Any) -> None:
        """Apply a body's `timeout`; a value that is not a positive number is a 400."""
        value = body.get("timeout") if isinstance(body, dict) else None
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise bad_request("'timeout' must be a positive number of seconds", "timeout")
        if self.seconds is None or value < self.seconds:
            self.seconds = float(value)
            self._place()

    def error(self) -> APIError:
        return APIError(
            504,
            f"The request exceeded its deadline of {self.seconds:g}s.",
            type="timeout_error",
            code="deadline_exceeded",
        )
