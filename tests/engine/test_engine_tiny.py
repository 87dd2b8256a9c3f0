"""The engine on tiny random Llama/Qwen2 models: token-exact against transformers, also under
KV pressure (offload, reload, recomputation), and every refusal and abort path ends cleanly."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from counting import CountingDict
from models import TINY_VOCAB, hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import (
    CPU_FIXED_SERVING_BATCHED_TOKENS,
    DEFAULT_BATCHED_TOKENS,
    LLMEngine,
)
from mstar.engine.outputs import ErrorKind
from mstar.engine.request import RequestStatus
from mstar.engine.resources.kv import KVRequestConfig
from mstar.engine.resources.step import ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import InvalidParameter, SamplingParams
from mstar.engine.scheduler import COPY_WAIT_SECONDS
from mstar.engine.step_budget import StepCostModel

NEW_TOKENS = 24


def _prompts(n: int = 16, seed: int = 7) -> list[list[int]]:
    """Mixed lengths (some longer than a page), some sharing a long prefix, no EOS token."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(21)]
    prompts = []
    for i in range(n):
        length = rng.choice([1, 3, 7, 9, 17, 30])
        tail = [rng.randrange(3, TINY_VOCAB) for _ in range(length)]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    return prompts


def _engine(folder: Path, **kw: object) -> LLMEngine:
    cfg = dict(model=str(folder), dtype="float32", device="cpu", page_size=4, seed=0)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]


def _sync_engine(folder: Path, serving: bool = False, **kw: object) -> LLMEngine:
    """The synchronous loop (tests that read or set state between steps), 512 pages unless
    told otherwise, ``serving``: the budget defaults behind the server."""
    cfg: dict[str, object] = dict(
        model=str(folder), dtype="float32", device="cpu", num_pages=512, async_scheduling="off"
    )
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg), serving=serving)  # type: ignore[arg-type]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, _prompts(), NEW_TOKENS)


def _assert_no_pages_held(engine: LLMEngine) -> None:
    kv = engine.kv
    kv.wait_copies()  # pages a copy still moves are released when it lands
    kv.assert_pages_conserved()
    assert kv.num_host_pages_used == 0
    assert not engine.has_unfinished_requests()


def test_greedy_matches_transformers_llama(tiny_llama_dir: Path, reference: list) -> None:
    engine = _engine(tiny_llama_dir, num_pages=256)
    # Two waves: the second finds the first wave's shared prefix pages in the cache.
    first = engine.generate(_prompts()[:8], GREEDY)
    assert engine.kv.prefix_hits == 0
    assert first + engine.generate(_prompts()[8:], GREEDY) == reference
    assert engine.kv.prefix_hits > 0
    _assert_no_pages_held(engine)


def test_greedy_matches_transformers_qwen2(tiny_qwen2_dir: Path) -> None:
    prompts = _prompts(6, seed=3)
    engine = _engine(tiny_qwen2_dir, num_pages=128, max_num_batched_tokens=16)
    assert engine.generate(prompts, GREEDY) == hf_greedy(tiny_qwen2_dir, prompts, NEW_TOKENS)


def test_step_budget_defaults_to_the_cpu_values_and_a_flag_wins(tiny_llama_dir: Path) -> None:
    """Unset, a CPU engine budgets DEFAULT_BATCHED_TOKENS (2048) per step offline, and behind the
    server with --step-budget fixed CPU_FIXED_SERVING_BATCHED_TOKENS (512): three 300-token
    prompts prefill in one step offline, in two behind the server (300 + 212, then 88 + 300); an
    explicit budget is honoured by both. The adaptive server budget is capped at the default."""
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)

    def finished_per_step(engine: LLMEngine) -> list[int]:
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i] * 300, one_token)
        counts = []
        while engine.has_unfinished_requests():
            counts.append(sum(o.finished for o in engine.step()))
        return counts

    def engine(serving: bool, **kw: object) -> LLMEngine:
        # Synchronous loop: the overlap loop delivers each step's tokens one call later.
        return _sync_engine(tiny_llama_dir, serving, **kw)

    offline, served = engine(False), engine(True, step_budget="fixed")
    assert offline.scheduler.config.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS == 2048
    assert offline.scheduler.step_budget is None
    assert served.scheduler.config.max_num_batched_tokens == CPU_FIXED_SERVING_BATCHED_TOKENS
    assert CPU_FIXED_SERVING_BATCHED_TOKENS == 512 and served.scheduler.step_budget is None
    assert finished_per_step(offline) == [3]
    assert finished_per_step(served) == [1, 2]
    for serving in (False, True):
        explicit = engine(serving, max_num_batched_tokens=1024, step_budget="fixed")
        assert explicit.scheduler.config.max_num_batched_tokens == 1024
        assert finished_per_step(explicit) == [3]
    adaptive = engine(True)
    assert adaptive.scheduler.step_budget is not None
    assert adaptive.scheduler.step_budget.cap == DEFAULT_BATCHED_TOKENS


def test_adaptive_budget_learns_from_steps_and_stays_exact(
    tiny_llama_dir: Path, reference: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind the server the budget follows the measured step costs: every executed step feeds the
    cost model, prompts are chunked where it says, and greedy output stays token-exact."""
    cfg = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_pages=512)
    engine = LLMEngine.from_config(cfg, serving=True)
    budget = engine.scheduler.step_budget
    assert budget is not None
    executed = []
    execute = engine.model_runner.execute
    monkeypatch.setattr(
        engine.model_runner,
        "execute",
        lambda batch, *prev: executed.append(batch) or execute(batch, *prev),
    )
    assert engine.generate(_prompts(), GREEDY) == reference
    assert budget.model.steps == len(executed) > 0
    assert budget.model.coef != StepCostModel().coef


def test_a_wave_at_an_idle_engine_is_prefilled_in_one_step(tiny_llama_dir: Path) -> None:
    """Behind the server, prompts arriving together at an idle engine all prefill in its first
    step (they fit the cap); a prompt arriving after the wave was prefilled, beside streams
    decoding, is no wave: the budget sees ``wave`` false (the stall bound applies to it).
    The synchronous loop: each step is committed before the state below is read."""
    engine = _sync_engine(tiny_llama_dir, True)
    budget = engine.scheduler.step_budget
    assert budget is not None
    waves: list[bool] = []
    tokens = budget.tokens

    def spy(*args: int | bool) -> int:
        waves.append(bool(args[4]))
        return tokens(*args)  # type: ignore[arg-type]

    budget.tokens = spy  # type: ignore[method-assign,assignment]
    prompts = _prompts()[:8]
    assert sum(map(len, prompts)) < budget.cap
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.step()
    assert all(r.num_uncomputed == 1 for r in engine.scheduler.running)
    assert len(engine.scheduler.running) == len(prompts) and waves == [True]
    for _ in range(2):
        engine.step()
    engine.add_request("late", prompts[0], params)
    engine.step()
    assert waves[-1] is False
    while engine.has_unfinished_requests():
        engine.step()


def test_chunked_prefill_with_small_budget_is_exact(tiny_llama_dir: Path, reference: list) -> None:
    engine = _engine(tiny_llama_dir, num_pages=256, max_num_batched_tokens=8, max_num_seqs=5)
    assert engine.generate(_prompts(), GREEDY) == reference


def test_tiny_pool_offloads_reloads_and_recomputes_exactly(
    tiny_llama_dir: Path, reference: list
) -> None:
    # 40 usable pages of 4 tokens for 16 requests of up to 75 tokens: they cannot all stay
    # resident; a 12-page host pool takes some victims and the rest are recomputed.
    engine = _engine(tiny_llama_dir, num_pages=41, host_offload_gb=12 * 2048 / 2**30)
    assert engine.generate(_prompts(), GREEDY) == reference
    c = engine.counters
    assert c.admit_failures > 0 and c.offloads > 0 and c.reloads > 0 and c.recomputations > 0
    _assert_no_pages_held(engine)


def test_priority_policy_also_exact(tiny_llama_dir: Path, reference: list) -> None:
    engine = _engine(
        tiny_llama_dir, num_pages=41, host_offload_gb=64 * 2048 / 2**30, eviction_policy="priority"
    )
    assert engine.generate(_prompts(), GREEDY) == reference
    assert engine.counters.offloads > 0


def _drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_request_too_long_for_pool_fails_cleanly_while_others_finish(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir, num_pages=9)  # 8 usable pages = 32 tokens
    engine.add_request("big", list(range(3, 43)), SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    outs = _drain(engine)
    big, ok = outs["big"][-1], outs["ok"][-1]
    assert big.finished and big.finish_reason == "error"
    assert big.error is not None and big.error.kind is ErrorKind.REJECTED
    assert "KV" in big.error.message or "pages" in big.error.message
    assert ok.finished and ok.finish_reason == "length" and ok.num_output_tokens == 4
    refusals = [e for o in outs["big"] for e in o.events if e.name == "admit_refused"]
    assert refusals and refusals[0].attributes["reason"] == "AdmitRuntimeError"
    _assert_no_pages_held(engine)


def test_context_length_checked_at_arrival(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_pages=64, max_model_len=32)
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("r", list(range(3, 30)), SamplingParams(max_tokens=10))
    assert err.value.param == "max_tokens" and "32" in str(err.value)
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("r", [TINY_VOCAB + 5], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("state", ["waiting", "running", "copying", "offloaded"])
def test_abort_in_every_state_frees_everything(tiny_llama_dir: Path, state: str) -> None:
    # Offloading by hand between steps needs nothing in flight: the synchronous loop there.
    by_hand = state in ("copying", "offloaded")
    engine = _engine(
        tiny_llama_dir,
        num_pages=64,
        host_offload_gb=32 * 2048 / 2**30,
        async_scheduling="off" if by_hand else "on",
    )
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    engine.add_request("b", list(range(3, 12)), params)
    if state != "waiting":
        engine.step()
        engine.step()
    req = engine.scheduler.requests["a"]
    kv = engine.kv
    if by_hand:
        if state == "copying":
            kv.copier.pause()  # claimed, the copy to the host still queued
        assert engine.runner.offload("a") > 0
        kv.wait_copies() if state == "offloaded" else None
        engine.step()  # admit meets the offloaded stream: the scheduler parks "a"
        assert kv.num_host_pages_used > 0
    expected = RequestStatus.RUNNING if state == "copying" else RequestStatus(state)
    assert req.status is expected
    assert kv.copy_in_flight("a") is (state == "copying")
    engine.abort_request("a")
    kv.copier.resume()
    outs = _drain(engine)
    assert outs["a"][-1].finish_reason == "abort"
    assert outs["b"][-1].finish_reason == "length"
    _assert_no_pages_held(engine)


def test_stop_token_and_eos_end_requests(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_pages=64)
    first = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0]
    stop_at = first[1]
    engine.add_request(
        "s", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    )
    outs = _drain(engine)
    final = outs["s"][-1]
    tokens = [t for o in outs["s"] for t in o.new_token_ids]
    assert final.finish_reason == "stop" and tokens[-1] == stop_at and len(tokens) <= 2


def test_seeded_sampling_reproducible_across_batch_compositions(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = _engine(tiny_llama_dir, num_pages=64).generate([[7, 8, 9]], params)[0]
    other = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    batched = _engine(tiny_llama_dir, num_pages=64).generate(
        [[3, 4], [7, 8, 9], list(range(10, 30))], [other, params, other]
    )
    assert batched[1] == alone


def test_logprobs_returned_per_token(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_pages=64)
    engine.add_request("l", [5, 6], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    outs = _drain(engine)["l"]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    toks = [t for o in outs for t in o.new_token_ids]
    assert [lp.token_id for lp in lps] == toks
    for lp in lps:
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id  # greedy picks the top-1
        assert lp.logprob <= 0


def test_request_offloading_parks_without_evicting_then_finishes_exactly(
    tiny_llama_dir: Path,
) -> None:
    prompts = [list(range(3, 20)), list(range(30, 41))]
    expected = hf_greedy(tiny_llama_dir, prompts, 12)
    # State set by hand between steps: the synchronous loop (nothing in flight).
    engine = _sync_engine(
        tiny_llama_dir, page_size=4, seed=0, num_pages=64, host_offload_gb=32 * 2048 / 2**30
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def collect(outs: list) -> list:
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
        return outs

    collect(engine.step())
    # Offload "a" behind the scheduler's back, and hold the copy in flight.
    kv = engine.kv
    kv.copier.pause()
    assert kv.offload("a") > 0 and kv.copy_in_flight("a")
    offloads = engine.counters.offloads
    a = engine.scheduler.requests["a"]

    def refusals(outs: list) -> list:
        return [
            (e.name, e.attributes["reason"]) for o in outs if o.request_id == "a" for e in o.events
        ]

    assert refusals(collect(engine.step())) == [("admit_refused", "RequestOffloading")]
    assert a.status is RequestStatus.RUNNING  # parked for the step: its KV is on the move
    assert engine.counters.offloads == offloads  # nothing evicted for it
    assert len(tokens["b"]) == 2  # the rest of the batch went on in the same step
    kv.copier.resume()
    kv.wait_copies()
    # The copy landed: the next admit finds it on the host and the scheduler reloads it.
    assert refusals(collect(engine.step())) == [("admit_refused", "RequestOffloading")]
    assert a.status is RequestStatus.OFFLOADED
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert engine.counters.reloads == 1
    assert [tokens["a"], tokens["b"]] == expected
    _assert_no_pages_held(engine)


def test_a_step_whose_rows_all_wait_on_a_copy_waits_for_it_instead_of_spinning(
    tiny_llama_dir: Path,
) -> None:
    """The only request's KV is on the move: each step waits up to COPY_WAIT_SECONDS for the
    copy. Returning at once spun the engine loop on refusals, taking the KV lock the copy needs
    to land faster than the copy thread got it: requests stuck for minutes under load."""
    # State set by hand between steps: the synchronous loop (nothing in flight).
    engine = _sync_engine(
        tiny_llama_dir, page_size=4, seed=0, num_pages=64, host_offload_gb=32 * 2048 / 2**30
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    engine.step()
    kv = engine.kv
    kv.copier.pause()
    assert kv.offload("a") > 0 and kv.copy_in_flight("a")
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.2:
        assert not any(o.new_token_ids for o in engine.step())  # parked while its KV moves
        steps += 1
    assert steps <= 0.2 / COPY_WAIT_SECONDS + 2
    kv.copier.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.reloads == 1
    _assert_no_pages_held(engine)


def test_a_step_whose_rows_are_all_held_sleeps_to_the_hold_end_instead_of_spinning(
    tiny_llama_dir: Path,
) -> None:
    """The only request sits in a hold window (as after an eviction) and no copy moves: each
    step sleeps toward the window's end (at most COPY_WAIT_SECONDS) instead of returning at
    once (millions of empty steps under memory pressure), and the request goes on after it."""
    # State set by hand between steps: the synchronous loop (nothing in flight).
    engine = _sync_engine(tiny_llama_dir, page_size=4, seed=0, num_pages=64, host_offload_gb=0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    engine.step()
    held = engine.scheduler.requests["a"]
    start = time.monotonic()
    held.hold_until = start + 0.2
    steps = 0
    while time.monotonic() < held.hold_until:
        assert not any(o.new_token_ids for o in engine.step())
        steps += 1
    assert 5 <= steps <= 0.2 / COPY_WAIT_SECONDS + 2  # not one sleep through the window
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    assert sum(len(o.new_token_ids) for o in out) == 7  # the first came before the hold
    _assert_no_pages_held(engine)


def test_a_burst_on_a_tiny_pool_finishes_exactly_without_an_eviction_storm(
    tiny_llama_dir: Path,
) -> None:
    # 32 requests submitted at once on a pool holding about a quarter of their peak demand.
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(10, 40))] for _ in range(32)
    ]
    params = [
        SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    peak = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    roomy = _engine(tiny_llama_dir, num_pages=512).generate(prompts, params)
    for host_gb in (0.0, 64 * 2048 / 2**30):
        engine = _engine(tiny_llama_dir, num_pages=peak // 4 // 4 + 1, host_offload_gb=host_gb)
        assert engine.generate(prompts, params) == roomy
        c = engine.counters
        assert c.evictions > 0  # the pool really was too small
        assert c.evictions / len(prompts) <= 1.5
        assert (c.offloads > 0) == (host_gb > 0) and (c.recomputations > 0) == (host_gb == 0)
        _assert_no_pages_held(engine)


def test_stats_and_steps_do_not_walk_a_large_prefix_index(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "0")  # the debug check walks everything
    n = 20_000
    engine = _engine(tiny_llama_dir, num_pages=n + 64, page_size=1, max_model_len=n + 8)
    # Fill the index with one long cached chain, straight through the KV resource.
    kv = engine.kv
    tokens = [3 + i % (TINY_VOCAB - 3) for i in range(n)]
    kv.ingest_request("fill", KVRequestConfig(tokens))
    step = ResourceStep(segments=(Segment("fill", "main", n),))
    ctx = StepContext(["fill"], "llm", 0, False)
    assert kv.admit(step, ctx).ok
    kv.commit(step, ctx)
    kv.remove_request("fill")
    prefix = kv.prefix
    assert prefix is not None and len(prefix) == n
    entries = prefix._entries = CountingDict(prefix._entries)
    page_keys = prefix._page_keys = CountingDict(prefix._page_keys)

    stats = engine.stats()
    assert stats.kv_usage == 0.0 and kv.num_cached_pages == n
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
        engine.stats()
    assert entries.walks == page_keys.walks == 0
