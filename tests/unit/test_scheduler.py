"""Scheduler: FCFS under a token budget with chunked prefill, holds, fairness to evicted
requests, and victim choice (outside the batch first; LRU or PRIORITY)."""

from __future__ import annotations

from mstar.engine.request import Request, RequestStatus
from mstar.engine.sampling_params import SamplingParams
from mstar.engine.scheduler import Scheduler, choose_victim


def _req(rid: str, prompt_len: int, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(), arrival)


def _rows(sched: Scheduler, now: float = 0.0) -> list[tuple[str, int]]:
    return [(r.request.request_id, r.num_tokens) for r in sched.schedule(now)]


def test_running_first_then_waiting_fcfs_with_last_prefill_chunked() -> None:
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = _req("a", 5, 1), _req("b", 6, 2), _req("c", 4, 3)
    for r in (a, b, c):
        sched.add(r)
    sched.mark_running(c)
    c.num_computed = 4  # decoding: one token to compute
    c.token_ids.append(7)
    assert _rows(sched) == [("c", 1), ("a", 5), ("b", 4)]
    assert a.status is RequestStatus.WAITING  # nothing changes until the engine admits


def test_max_num_seqs_and_holds() -> None:
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [_req(str(i), 3, i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    reqs[0].hold_until = 5.0
    assert _rows(sched, now=1.0) == [("1", 3), ("2", 3)]
    assert _rows(sched, now=6.0) == [("0", 3), ("1", 3)]


def test_waiting_queue_closed_while_evicted_requests_wait_and_others_run() -> None:
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    old, running, new = _req("old", 4, 0), _req("run", 4, 1), _req("new", 4, 2)
    for r in (old, running, new):
        sched.add(r)
    sched.mark_running(running)
    sched.mark_offloaded(old)
    assert _rows(sched) == [("run", 4)]
    sched.discard(running)  # nothing runs: the queue opens so the pool cannot deadlock
    assert _rows(sched) == [("new", 4)]


def test_recompute_requeues_ahead_of_newer_arrivals() -> None:
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    victim, newer = _req("v", 4, 0), _req("n", 4, 1)
    sched.add(newer)
    sched.add(victim)
    sched.mark_running(victim)
    victim.num_computed = 4
    sched.requeue_for_recompute(victim)
    assert victim.num_computed == 0 and victim.status is RequestStatus.WAITING
    assert _rows(sched) == [("v", 4), ("n", 4)]


def test_victim_outside_batch_first_then_lru_newest_on_ties() -> None:
    a, b, c = _req("a", 1, 0), _req("b", 1, 1), _req("c", 1, 2)
    a.last_active_step, b.last_active_step, c.last_active_step = 5, 3, 3
    assert choose_victim([a, b, c], batch_ids={"b", "c"}) is a
    assert choose_victim([a, b, c], batch_ids=set()) is c  # LRU tie: newest arrival
    assert choose_victim([], batch_ids=set()) is None


def test_priority_policy_asks_for_the_highest_priority() -> None:
    a, b = _req("a", 1, 0), _req("b", 1, 1)
    pages = {"a": 7.0, "b": 2.0}
    assert choose_victim([a, b], set(), priority=lambda r: pages[r.request_id]) is a
