"""The scheduler owns admission: who runs each step, and what happens when memory runs out.

Each step (`schedule`):

1. **Reload** offloaded requests, oldest first, while free pages allow (FCFS: a younger one never
   jumps ahead of an older one).
2. **Pick rows** under the token budget: every running request (a decode token or its next
   prefill chunk), then waiting requests in arrival order, each only if its whole remaining
   prompt fits in free plus evictable pages, after what the running rows need this step and a
   small watermark. A new arrival never causes an eviction: eviction exists to let *running*
   requests grow. While an evicted request waits for reload, new arrivals wait too.
3. **Declare and admit** the step through the `StepRunner`, answering each refusal by its type:
   - `AllocationFailed` for a new row: drop it and later arrivals from this step. For a running
     row: if pages are already on their way back (offloads in flight), park it this step;
     otherwise evict one victim (LRU, or PRIORITY via `get_offload_priority`) that is neither
     inside its protection window (just admitted or reloaded) nor evicted too often already.
     The victim goes to host memory, or, when the host pool cannot take it, is reset in every
     resource and prefilled again later (its tokens and sampler state stay).
   - `RequestOffloading`: its KV is on the move; park it this step, evict nothing. Any other
     refusal (a resource out of some slot) is answered the same way.
   - `AdmitRuntimeError`: the request can never be served as asked; fail it (typed error).

`update` commits the executed step, appends sampled tokens, applies stop rules and returns the
requests' outputs. Every request ends finished, failed with a typed error, or aborted; removal
frees all of its pages (device and host) at once.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar.engine.batch import (
    ScheduledBatch,
    ScheduledRow,
    cap_scored,
    declare_step,
    eager_context,
    is_batched_decode,
    prompt_scores,
)
from mstar.engine.outputs import ErrorKind, FinishReason, RequestError
from mstar.engine.request import Request, RequestStatus
from mstar.engine.resources.kv import KVCacheResource
from mstar.engine.resources.kv.capacity import KVCapacity
from mstar.engine.resources.refusals import reason_name
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.step import (
    AdmitRuntimeError,
    AllocationFailed,
    FullAdmitOutcome,
    RequestOffloading,
    StepContext,
    SubmoduleStep,
)
from mstar.engine.step_budget import StepBudget
from mstar.engine.step_update import StepUpdate

#: Builds a step's context from its request ids and whether it is a batched decode.
MakeContext = Callable[[list[str], bool], StepContext]


#: Most prompt positions one step scores (`prompt_logprobs`): their logits rows are held at
#: once (512 x 49,152 x 4 bytes = 100 MB for SmolLM2 in float32), so a scored prefill is
#: chunked to this many scored positions a step.
MAX_SCORED_ROWS = 512

#: Longest a step that runs nothing waits for an in-flight KV copy before scheduling again.
COPY_WAIT_SECONDS = 0.01


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    #: "lru" or "priority".
    eviction_policy: str = "lru"
    max_model_len: int = 4096
    eos_token_ids: frozenset[int] = frozenset()
    #: An evicted victim is not reloaded before this; an admitted or reloaded request is not
    #: evicted before this (no offload ping-pong).
    hold_seconds: float = 0.05
    #: A request evicted this many times is protected: it is never chosen again while any
    #: other victim exists, so it finishes.
    max_evictions: int = 2
    #: Pages left free when admitting new requests, as a fraction of the pool (at least one).
    watermark: float = 0.01
    #: Budget each step from measured step costs (`StepBudget`), capped at
    #: `max_num_batched_tokens`; otherwise every step takes up to that many tokens.
    adaptive_budget: bool = False


@dataclass
class SchedulerCounters:
    """Cumulative counts (tests assert that eviction paths really ran)."""

    admit_failures: int = 0
    evictions: int = 0
    offloads: int = 0
    reloads: int = 0
    recomputations: int = 0


class Scheduler(StepUpdate):
    """Queues of waiting, running and offloaded requests; admission, eviction and reload."""

    def __init__(
        self,
        runner: StepRunner,
        kv: KVCacheResource,
        config: SchedulerConfig,
        make_context: MakeContext = eager_context,
    ) -> None:
        self.runner = runner
        #: Capacity questions only; KV state changes go through `runner`.
        self.kv = KVCapacity(kv)
        self.config = config
        self.counters = SchedulerCounters()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: In arrival order: reloads are FCFS.
        self.offloaded: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self._watermark = max(1, int(kv.num_pages * config.watermark))
        self._touched: dict[str, Request] = {}
        self._finished: list[Request] = []
        self._priority: Callable[[Request, str], float] | None = (
            self._offload_priority if config.eviction_policy == "priority" else None
        )
        #: The model runner's `step_context` (a slot lease when graphs or pre-planning are on).
        self.make_context = make_context
        self.step_budget: StepBudget | None = (
            StepBudget(config.max_num_batched_tokens) if config.adaptive_budget else None
        )
        #: prompts pending since the engine last had nobody decoding (`StepBudget`'s wave)
        self._wave = False

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.offloaded)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished)

    # -- requests --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.runner.ingest_request(request.request_id, request.overrides)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Stop a request in any state; its pages (device and host) are freed at once."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, FinishReason.ABORT)

    # -- schedule ----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """This step's admitted batch, or None when nothing can run now."""
        self.step_index += 1
        now = time.monotonic()
        self._reload(now)
        rows = self._pick_rows(now)
        while rows:
            step, sample_rows = self._declare(rows)
            outcome = self.runner.admit(step)
            if outcome.ok:
                for r in rows:
                    if r.request.status is RequestStatus.WAITING:
                        self._move(r.request, RequestStatus.RUNNING)
                        r.request.protected_until = now + self.config.hold_seconds
                    if r.request.first_scheduled_time is None:
                        r.request.first_scheduled_time = now
                return ScheduledBatch(rows, step, sample_rows, prompt_scores(rows))
            rows = self._answer(outcome, rows, now)
        # Nothing runs: if that is because rows wait on copies, wait for one to land here.
        # Returning at once made the engine loop spin on refusals, taking the KV lock the
        # landing needs faster than the copy thread could get it (requests stuck for minutes).
        if not self.kv.wait_copy_progress(COPY_WAIT_SECONDS):
            self._wait_out_holds(now)
        return None

    def _wait_out_holds(self, now: float) -> None:
        """Nothing ran and no copy moves: where requests sit in their hold windows (after an
        eviction or a refusal), sleep to the first one's end, at most COPY_WAIT_SECONDS.
        Returning at once spun the engine loop through empty steps (3.2M in 120 s of a
        memory-pressure run), holding the GIL the server's thread streams with."""
        queues = itertools.chain(self.running, self.waiting, self.offloaded)
        end = min((r.hold_until for r in queues if r.hold_until > now), default=now)
        if end > now:
            time.sleep(min(end - now, COPY_WAIT_SECONDS))

    def _budget(self, now: float) -> int:
        """This step's token budget: fixed, or from the measured step costs (`StepBudget`)."""
        if self.step_budget is None:
            return self.config.max_num_batched_tokens
        decode_rows = prompts = pending = head = scored = 0
        for req in self.running:
            n = req.num_uncomputed
            if req.hold_until > now or n <= 0:
                continue
            if n == 1:
                decode_rows += 1
            else:
                prompts += 1
                pending += n
                head = head or n
                scored += req.num_scored(n)
        if not self.offloaded:
            for req in itertools.islice(self.waiting, self.config.max_num_seqs):
                prompts += 1
                pending += req.num_uncomputed
                head = head or req.num_uncomputed
                scored += req.num_scored(req.num_uncomputed)
        # A wave: prompts reaching an idle engine, and those that arrive before its last prompt
        # is prefilled (a client's batch lands over a few steps, not in one).
        if pending == 0:
            self._wave = False
        elif decode_rows == 0:
            self._wave = True
        share = scored / pending if pending else 0.0
        return self.step_budget.tokens(decode_rows, prompts, pending, head, self._wave, share)

    def observe_cost(self, batch: ScheduledBatch, seconds: float) -> None:
        """Feed an executed step's time to the adaptive budget's cost model."""
        if self.step_budget is not None:
            decode_rows = sum(1 for r in batch.rows if r.num_tokens == 1)
            prompt = sum(r.num_tokens for r in batch.rows if r.num_tokens > 1)
            scored = sum(len(s.targets) for s in batch.scored)
            self.step_budget.observe(decode_rows, prompt, seconds, scored)

    def _pick_rows(self, now: float) -> list[ScheduledRow]:
        cfg = self.config
        rows: list[ScheduledRow] = []
        budget = self._budget(now)
        available = self.kv.room() - self._watermark
        score_room = MAX_SCORED_ROWS
        for req in self.running:
            if len(rows) >= cfg.max_num_seqs or budget <= 0:
                return rows
            if req.hold_until > now:
                continue
            n, score_room = cap_scored(req, min(req.num_uncomputed, budget), score_room)
            if n <= 0:
                continue
            rows.append(ScheduledRow(req, n))
            budget -= n
            available -= self.kv.pages_to_grow(req.request_id, req.num_computed + n)
        if self.offloaded:
            return rows  # freed pages go to the evicted (older) requests first
        for req in self.waiting:
            if len(rows) >= cfg.max_num_seqs or budget <= 0 or req.hold_until > now:
                break
            # Waiting requests hold no pages: the prefix is only probed until they are admitted.
            need = self.kv.pages_to_admit(req.token_ids)
            # A request bigger than the whole pool goes to admit, so the KV cache refuses it
            # (AdmitRuntimeError) instead of it blocking the queue forever.
            if need > available and need <= self.kv.num_pages and (rows or self.running):
                break
            self._match_prefix(req)
            n, score_room = cap_scored(req, min(req.num_uncomputed, budget), score_room)
            if n <= 0:
                self._unmatch(req)
                break
            rows.append(ScheduledRow(req, n))
            budget -= n
            available -= need
        return rows

    def _match_prefix(self, req: Request) -> None:
        """Reuse cached prefix pages for a request about to (re)prefill. One that scores its
        prompt reads none (as in vLLM): each scored position must run to have logits, so its
        whole prompt is prefilled (its pages still join the index for later requests)."""
        if req.num_computed == 0 and not req.scores_prompt:
            matched = self.kv.match_prefix(req.request_id, req.token_ids)
            req.num_computed = matched
            req.num_cached_tokens = max(req.num_cached_tokens, matched)

    def _unmatch(self, req: Request) -> None:
        """Give back the prefix pages a waiting request matched for a step it did not get."""
        if req.status is RequestStatus.WAITING and self.kv.holds_pages(req.request_id):
            self.runner.reset_request(req.request_id, free=True)
            req.num_computed = self.kv.stored_len(req.request_id)

    def _declare(self, rows: list[ScheduledRow]) -> tuple[SubmoduleStep, list[int]]:
        """The step over `rows` with this scheduler's context, and the rows that sample."""
        step, sample_rows = declare_step(rows)
        ids = [r.request.request_id for r in rows]
        step.set_ctx(self.make_context(ids, is_batched_decode(rows, sample_rows)))
        return step, sample_rows

    # -- refusals ----------------------------------------------------------------------------------
    def _answer(
        self, outcome: FullAdmitOutcome, rows: list[ScheduledRow], now: float
    ) -> list[ScheduledRow]:
        """Answer one refusal; returns the rows to try again (always fewer, or a victim gone)."""
        reason = outcome.reason
        resource = outcome.failed_resource or "?"
        self.counters.admit_failures += 1
        in_batch = {r.request.request_id: i for i, r in enumerate(rows)}
        index = in_batch.get(getattr(reason, "request_id", None) or "", len(rows) - 1)
        blamed = rows[index].request
        attrs: dict[str, Any] = {
            "reason": reason_name(reason),
            "resource": resource,
            "message": reason.message if reason is not None else "",
        }
        if isinstance(reason, AllocationFailed | RequestOffloading):
            attrs["label"] = reason.label  # which stream of the resource refused
        if isinstance(reason, AllocationFailed):
            attrs["pages_short"] = reason.pages_short
        if isinstance(reason, AdmitRuntimeError):
            culprit = blamed
            if getattr(reason, "request_id", None) not in in_batch:
                # The seed's class names no request (our resources refuse with
                # `RequestRejected`, which does): find it the slow way.
                culprit = self._isolate_terminal_refusal(rows) or blamed
            self._event(culprit, "admit_refused", now, attrs)
            message = f"resource {resource} rejected the request: {reason.message}"
            self._finish(culprit, FinishReason.ERROR, RequestError(ErrorKind.REJECTED, message))
            return [r for r in rows if r.request is not culprit]
        self._event(blamed, "admit_refused", now, attrs)
        if not isinstance(reason, AllocationFailed | RequestOffloading):
            blamed.hold_until = now + getattr(reason, "retry_after", 0.0)  # (adapter loads)
            return rows[:index] + rows[index + 1 :]  # any other refusal: push back, retry
        if isinstance(reason, RequestOffloading):
            if (
                blamed.status is RequestStatus.RUNNING
                and not self.kv.copy_in_flight(blamed.request_id)
                and self.runner.is_offloaded(blamed.request_id)
            ):
                self._move(blamed, RequestStatus.OFFLOADED)  # offloaded behind our back
            return rows[:index] + rows[index + 1 :]
        if blamed.status is RequestStatus.WAITING:
            # A new arrival that does not fit waits, holding nothing; it never evicts anyone.
            for r in rows[index:]:
                self._unmatch(r.request)
            return rows[:index]
        if self.kv.pages_in_transit() >= reason.pages_short:
            return rows[:index] + rows[index + 1 :]  # pages are on their way: wait for them
        victim = self._choose_victim(resource, blamed, now)
        if victim is None:
            blamed.hold_until = now + self.config.hold_seconds
            return rows[:index] + rows[index + 1 :]
        self._evict(victim, resource, now)
        return [r for r in rows if r.request is not victim]

    def _choose_victim(self, resource: str, blamed: Request, now: float) -> Request | None:
        """The running request to evict: outside its protection window, not evicted too often;
        LRU by last active step (newest arrival on ties), or the highest offload priority."""
        candidates = [
            r
            for r in self.running
            if r.protected_until <= now and self.runner.reclaimable(r.request_id, [resource]) > 0
        ]
        fresh = [r for r in candidates if r.num_evictions < self.config.max_evictions]
        pool = fresh or [r for r in candidates if r is blamed]
        if not pool:
            return None
        if self._priority is not None:
            priority = self._priority
            return max(pool, key=lambda r: (priority(r, resource), r.arrival_time))
        return min(pool, key=lambda r: (r.last_active_step, -r.arrival_time))

    def _offload_priority(self, req: Request, resource: str) -> float:
        return self.runner.offload_priority(req.request_id, [resource])

    def _evict(self, victim: Request, resource: str, now: float) -> None:
        self.counters.evictions += 1
        victim.num_evictions += 1
        victim.hold_until = now + self.config.hold_seconds
        freed = self.runner.offload(victim.request_id, [resource])
        if freed > 0:
            self.counters.offloads += 1
            self._move(victim, RequestStatus.OFFLOADED)
            self._event(victim, "evicted", now, {"resource": resource, "pages": freed})
            self._event(victim, "offloaded", now, {"resource": resource, "pages": freed})
            return
        # The host pool cannot take it: drop its state everywhere, keep its tokens.
        pages = self.runner.reclaimable(victim.request_id, [resource])
        self.runner.reset_request(victim.request_id, free=True)
        victim.num_computed = self.kv.stored_len(victim.request_id)
        self.counters.recomputations += 1
        self._move(victim, RequestStatus.WAITING, front=True)
        attrs = {"resource": resource, "pages": pages, "mode": "recompute"}
        self._event(victim, "evicted", now, attrs)
        self._event(victim, "recomputed", now, {"resource": resource, "tokens": victim.num_tokens})

    def _isolate_terminal_refusal(self, rows: list[ScheduledRow]) -> Request | None:
        """A nameless batch refusal that no eviction cures: the row that is refused alone."""
        if len(rows) == 1:
            return rows[0].request
        for r in rows:
            probe, _ = self._declare([r])
            outcome = self.runner.admit(probe)
            if outcome.ok:
                self.runner.abort_step(probe)
            elif isinstance(outcome.reason, AdmitRuntimeError):
                return r.request
        return None

    def _reload(self, now: float) -> None:
        """Bring offloaded requests back, oldest first, while free pages allow."""
        for req in list(self.offloaded):
            if req.hold_until > now or self.kv.copy_in_flight(req.request_id):
                return
            room = self.kv.room() - self._watermark
            if self.running and room < self.kv.pages_for(req.num_computed) + 1:  # + one to grow
                return
            if not self.runner.reload(req.request_id):
                return
            self.counters.reloads += 1
            req.protected_until = now + self.config.hold_seconds
            self._event(req, "reloaded", now, {})
            self._move(req, RequestStatus.RUNNING)

    # -- bookkeeping -------------------------------------------------------------------------------
    def _move(self, req: Request, status: RequestStatus, front: bool = False) -> None:
        self._unqueue(req)
        req.status = status
        if status is RequestStatus.RUNNING:
            self.running.append(req)
        elif status is RequestStatus.WAITING:
            self.waiting.appendleft(req) if front else self.waiting.append(req)
        elif status is RequestStatus.OFFLOADED:
            self.offloaded.append(req)
            self.offloaded.sort(key=lambda r: r.arrival_time)

    def _unqueue(self, req: Request) -> None:
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.OFFLOADED:
            self.offloaded.remove(req)

    def _event(self, req: Request, name: str, now: float, attrs: dict[str, Any]) -> None:
        req.event(name, now, **attrs)
        self._touched[req.request_id] = req

    def _finish(
        self, req: Request, reason: FinishReason, error: RequestError | None = None
    ) -> None:
        self._unqueue(req)
        self.runner.remove_request(req.request_id)
        req.drop_reserved()
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_time = time.monotonic()
        self._touched.pop(req.request_id, None)
        self._finished.append(req)


__all__ = ["MAX_SCORED_ROWS", "Scheduler", "SchedulerConfig", "SchedulerCounters"]
