"""What every handler of one app shares: the engine, its metrics and traces, the drain state."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from mstar.engine.server.async_engine import AsyncEngine, EngineLike
from mstar.engine.server.metrics import ServerMetrics
from mstar.engine.server.telemetry import Telemetry

if TYPE_CHECKING:
    from mstar.engine.server.lifecycle import Generation

#: What a 429 (at capacity) or a 503 (draining) tells the client to wait before retrying.
RETRY_AFTER_SECONDS = 1
#: How long a request that finds the waiting queue full waits for room before its 429. A
#: client that ignores `Retry-After` is held that long anyway, so a flood of them cannot keep
#: the event loop busy answering refusals (and the engine thread short of the GIL); one that
#: waits is admitted as soon as a request ends.
ROOM_WAIT_SECONDS = float(RETRY_AFTER_SECONDS)


@dataclass
class ServerState:
    """Everything the handlers share; one per app."""

    engine: EngineLike
    async_engine: AsyncEngine
    metrics: ServerMetrics
    telemetry: Telemetry
    model_name: str
    max_model_len: int
    api_key: str | None
    max_waiting_requests: int
    #: Every request's deadline in seconds from arrival (None: only a body's `timeout`).
    request_timeout: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    #: When the last request arrived (monotonic); the preStop hook waits for a quiet spell.
    last_arrival: float = field(default_factory=time.monotonic)
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    generations: set[Generation] = field(default_factory=set)
    #: Requests waiting for room in a full queue (`wait_for_room`), oldest first.
    room_waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
        while self.room_waiters:  # a request ended: the oldest waiter looks for room
            waiter = self.room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def has_room(self) -> bool:
        return self.async_engine.num_waiting() < self.max_waiting_requests

    async def wait_for_room(self) -> bool:
        """True once the waiting queue has room, False after `ROOM_WAIT_SECONDS` without.

        Each ending request wakes the oldest waiter; one that finds no room yet (the engine
        admits its next request on its next step) keeps its place at the front.
        """
        if self.has_room():
            return True
        loop = asyncio.get_running_loop()
        end = loop.time() + ROOM_WAIT_SECONDS
        first = True
        while True:
            waiter = loop.create_future()
            if first:
                self.room_waiters.append(waiter)
            else:
                self.room_waiters.appendleft(waiter)
            first = False
            try:
                async with asyncio.timeout_at(end):
                    await waiter
            except TimeoutError:
                return self.has_room()
            if self.has_room():
                return True


STATE: web.AppKey[ServerState] = web.AppKey("mstar_state", ServerState)
