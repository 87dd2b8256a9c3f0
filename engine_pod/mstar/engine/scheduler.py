"""Continuous batching: which requests run this step, with how many tokens, and who is evicted.

FCFS under a token budget: running requests go first (a decode token, or the next chunk of an
unfinished prefill), then waiting requests in arrival order, the last one chunked to fit the
budget. The scheduler only chooses; the engine asks the resources and reports refusals back
(`choose_victim`), so every capacity decision is made by the resource that owns the capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from mstar.engine.request import Request, RequestStatus


class ScheduledRow(NamedTuple):
    request: Request
    num_tokens: int


class Scheduler:
    """Queues of waiting, running and offloaded requests, and the per-step batch choice."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.offloaded: list[Request] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.offloaded)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def discard(self, request: Request) -> None:
        """Forget the request, whatever queue holds it."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.OFFLOADED:
            self.offloaded.remove(request)

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting
        yield from self.offloaded

    # -- transitions the engine drives ---------------------------------------------------------
    def mark_running(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            return
        self.discard(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def mark_offloaded(self, request: Request) -> None:
        self.discard(request)
        request.status = RequestStatus.OFFLOADED
        self.offloaded.append(request)

    def requeue_for_recompute(self, request: Request) -> None:
        """Its KV is gone but its tokens stay: prefill it again, ahead of newer arrivals."""
        self.discard(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        self.waiting.appendleft(request)

    # -- the batch -----------------------------------------------------------------------------
    def schedule(self, now: float) -> list[ScheduledRow]:
        """This step's rows; statuses do not change until the engine admits them.

        While evicted requests wait on host memory and others still run, the waiting queue
        stays closed: pages freed by finishing requests go to the evicted (older) requests
        first, so a stream of new arrivals cannot starve them.
        """
        rows: list[ScheduledRow] = []
        budget = self.max_num_batched_tokens
        queues = (
            (self.running,) if self.offloaded and self.running else (self.running, self.waiting)
        )
        for queue in queues:
            for req in queue:
                if len(rows) >= self.max_num_seqs or budget <= 0:
                    return rows
                if req.hold_until > now:
                    continue
                n = min(req.num_uncomputed, budget)
                if n <= 0:
                    continue
                rows.append(ScheduledRow(req, n))
                budget -= n
        return rows


def choose_victim(
    candidates: Iterable[Request],
    batch_ids: set[str],
    priority: Callable[[Request], float] | None = None,
) -> Request | None:
    """Pick whom to evict: outside the batch first; LRU by last step (newest arrival on ties),
    or, under the PRIORITY policy, the highest `priority` (the resource's offload priority)."""
    pool = list(candidates)
    if not pool:
        return None
    outside = [r for r in pool if r.request_id not in batch_ids]
    pool = outside or pool
    if priority is not None:
        return max(pool, key=lambda r: (priority(r), r.arrival_time))
    return min(pool, key=lambda r: (r.last_active_step, -r.arrival_time))
