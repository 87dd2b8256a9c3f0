"""What every handler of one app shares: the engine, its metrics and traces, the drain state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from mstar.engine.server.async_engine import AsyncEngine, EngineLike
from mstar.engine.server.limits import Admission
from mstar.engine.server.metrics import ServerMetrics
from mstar.engine.server.telemetry import Telemetry

if TYPE_CHECKING:
    from mstar.engine.server.lifecycle import Generation


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
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.max_waiting_requests, self.async_engine.num_waiting)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
        self.admission.room_freed()


STATE: web.AppKey[ServerState] = web.AppKey("mstar_state", ServerState)
