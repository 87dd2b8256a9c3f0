"""Steady streaming traffic against a server, and the account of every request it sent.

`Traffic` runs ``clients`` back-to-back streaming completions on a thread of its own while a
test breaks the server. Each request ends in exactly one way: finished (a finish reason and
`[DONE]`), refused (an HTTP status, with or without `Retry-After`), failed (an error event, a
connection that ended mid-stream, nothing listening), disconnected on purpose by the client, or
hanging: still open at its deadline. `Account.check` says none is lost and none hangs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Outcome:
    """One request: when it started and ended (monotonic), how, and what the server said."""

    start: float
    end: float
    kind: str  # finished | refused | failed | disconnected | hanging
    detail: str = ""


@dataclass
class Account:
    outcomes: list[Outcome] = field(default_factory=list)
    started: int = 0

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def details(self, kind: str) -> Counter[str]:
        return Counter(o.detail for o in self.outcomes if o.kind == kind)

    def in_flight_at(self, moment: float) -> list[Outcome]:
        """Requests sent before ``moment`` that had not ended by then."""
        return [o for o in self.outcomes if o.start < moment <= o.end]

    def __str__(self) -> str:
        parts = [f"started {self.started}", f"finished {self.count('finished')}"]
        for kind in ("refused", "failed", "disconnected", "hanging"):
            if self.count(kind):
                parts.append(f"{kind} {self.count(kind)} {dict(self.details(kind))}")
        return "; ".join(parts)

    def check(self) -> None:
        """Every request accounted for, none hanging past its deadline."""
        assert len(self.outcomes) == self.started, f"requests lost: {self}"
        assert self.count("hanging") == 0, f"requests hung: {self}"


class Traffic:
    """``clients`` streaming posters on a background thread; `stop` ends them and returns the
    account. ``disconnect_every``: every n-th request is dropped by its client after its first
    event (its pages must come back). ``stagger``: client c asks ``max_tokens + c * stagger``
    tokens, so streams end at different steps rather than all in one."""

    def __init__(
        self,
        url: str,
        clients: int = 8,
        *,
        max_tokens: int = 48,
        deadline: float = 30.0,
        disconnect_every: int = 0,
        stagger: int = 0,
    ) -> None:
        self.url = url
        self.clients = clients
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.disconnect_every = disconnect_every
        self.stagger = stagger
        self.account = Account()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_finished(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` requests finished normally (the load is steady)."""
        end = time.monotonic() + timeout
        while self.account.count("finished") < n:
            assert time.monotonic() < end, f"traffic never got going: {self.account}"
            time.sleep(0.05)

    def stop(self, timeout: float | None = None) -> Account:
        """No new requests; wait for those in flight (they end by their deadline)."""
        self._stopping.set()
        self._thread.join(self.deadline + 10 if timeout is None else timeout)
        assert not self._thread.is_alive(), f"traffic did not stop: {self.account}"
        return self.account

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.deadline)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(self._client(session, c) for c in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, c: int) -> None:
        n = 0
        while not self._stopping.is_set():
            n += 1
            drop = self.disconnect_every > 0 and (n * self.clients + c) % self.disconnect_every == 0
            tokens = self.max_tokens + c * self.stagger
            outcome = await self._one(session, [3 + c % 90, 4 + n % 90, 5], tokens, drop)
            self.account.outcomes.append(outcome)
            if outcome.detail == "nothing listening":
                return  # the server is gone; nothing more to send
            if outcome.kind != "finished":
                await asyncio.sleep(0.05)  # a refused client does not spin

    async def _one(
        self, session: aiohttp.ClientSession, prompt: list[int], tokens: int, drop: bool
    ) -> Outcome:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }
        self.account.started += 1
        start = time.monotonic()

        def end(kind: str, detail: str = "") -> Outcome:
            return Outcome(start, time.monotonic(), kind, detail)

        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    retry = " Retry-After" if "Retry-After" in resp.headers else ""
                    await resp.read()
                    return end("refused", f"{resp.status}{retry}")
                events: list[str] = []
                async for line in resp.content:
                    text = line.decode().strip()
                    if not text.startswith("data:"):
                        continue
                    events.append(text[5:].strip())
                    if drop:
                        return end("disconnected")
                return _stream_outcome(events, end)
        except TimeoutError:
            return end("hanging")
        except aiohttp.ClientConnectorError:
            return end("failed", "nothing listening")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, OSError) as exc:
            return end("failed", f"connection ended ({type(exc).__name__})")


def _stream_outcome(events: list[str], end: Callable[..., Outcome]) -> Outcome:
    """A complete SSE body: an error event makes it failed; no `[DONE]`, failed too."""
    if not events or events[-1] != "[DONE]":
        return end("failed", "stream ended without [DONE]")
    for data in events[:-1]:
        payload = json.loads(data)
        if "error" in payload:
            message = payload["error"]["message"]
            return end("failed", "error event: " + message.split(":")[0])
    return end("finished")
