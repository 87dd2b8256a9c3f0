"""The overlap loop (`--async-scheduling on`, CUDA's default) against the synchronous loop and
transformers: tokens read one step late change nothing a client sees. A finished request's
extra token (stop id, EOS, max tokens, abort, eviction) never reaches an output, and every page
comes back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from models import TINY_VOCAB, hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.outputs import RequestOutput
from mstar.engine.sampling_params import SamplingParams

NEW = 20


def _engine(folder: Path, overlap: bool, **kw: object) -> LLMEngine:
    cfg = dict(
        model=str(folder),
        dtype="float32",
        device="cpu",
        page_size=4,
        num_pages=256,
        seed=0,
        async_scheduling="on" if overlap else "off",
    )
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([2, 5, 9, 17]))] for _ in range(n)
    ]


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every output per request, in order; asserts nothing follows a finished output."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    outs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert not (outs[o.request_id] and outs[o.request_id][-1].finished), o
            outs[o.request_id].append(o)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _no_pages_held(engine: LLMEngine) -> None:
    engine.kv.wait_copies()
    engine.kv.assert_pages_conserved()
    assert engine.kv.num_host_pages_used == 0
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(10)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, prompts, NEW)


def test_greedy_exact_and_max_tokens_costs_no_extra_step(
    tiny_llama_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Token-exact against transformers and the synchronous loop, in as many executed steps:
    a request whose last token is in flight is not scheduled again when that token ends it."""
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)] * len(prompts)
    sync, over = _engine(tiny_llama_dir, False), _engine(tiny_llama_dir, True)
    a, b = _run(sync, prompts, params), _run(over, prompts, params)
    assert [_tokens(a[f"r{i}"]) for i in range(len(prompts))] == reference
    assert [_tokens(b[f"r{i}"]) for i in range(len(prompts))] == reference
    assert over.executed_steps == sync.executed_steps
    for outs in b.values():
        assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"
        assert outs[-1].num_output_tokens == NEW
    _no_pages_held(over)


def test_stop_ids_and_max_tokens_exact_with_the_lag(
    tiny_llama_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Stop ids at every position (the stopping token's successor is already computed when it
    is read) and mixed max_tokens: the extra token never streams, usage counts are exact."""
    params, expected = [], []
    for i, ref in enumerate(reference):
        if i % 2:
            stop_at = 1 + i % (NEW - 2)
            stop = ref[stop_at]
            first = ref.index(stop)
            params.append(SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[stop]))
            expected.append(ref[: first + 1])
        else:
            n = 1 + (3 * i) % NEW
            params.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            expected.append(ref[:n])
    over = _engine(tiny_llama_dir, True)
    sync = _engine(tiny_llama_dir, False)
    for engine in (over, sync):
        outs = _run(engine, prompts, params)
        for i, want in enumerate(expected):
            got = outs[f"r{i}"]
            assert _tokens(got) == want, i
            assert got[-1].finished and got[-1].num_output_tokens == len(want)
            reason = "stop" if i % 2 else "length"
            assert got[-1].finish_reason is not None and got[-1].finish_reason.value == reason
        _no_pages_held(engine)


def test_abort_mid_stream_streams_nothing_more(
    tiny_llama_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """An abort while the request's next token is in flight: that token is discarded, the
    request's pages free at once, the others stay exact."""
    engine = _engine(tiny_llama_dir, True)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    ended: dict[str, str] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in ended
            got[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason is not None
                ended[o.request_id] = o.finish_reason.value
        if not aborted and len(got["r1"]) >= 5:
            assert engine.overlap is not None and engine.overlap.inflight is not None
            held = len(got["r1"])
            engine.abort_request("r1")
            aborted = True
    assert aborted and ended["r1"] == "abort" and got["r1"] == reference[1][:held]
    for i in (0, 2, 3):
        assert got[f"r{i}"] == reference[i] and ended[f"r{i}"] == "length"
    _no_pages_held(engine)


@pytest.mark.parametrize("host_gb", [0.01, 0.0], ids=["offload", "recompute"])
def test_eviction_under_a_tiny_pool_stays_exact(
    tiny_llama_dir: Path, prompts: list[list[int]], reference: list[list[int]], host_gb: float
) -> None:
    """Victims evicted (offloaded, or dropped and recomputed) while their token is in flight
    come back exact; nothing is leaked."""
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)] * len(prompts)
    engine = _engine(tiny_llama_dir, True, num_pages=20, host_offload_gb=host_gb)
    outs = _run(engine, prompts, params)
    assert [_tokens(outs[f"r{i}"]) for i in range(len(prompts))] == reference
    assert engine.counters.evictions > 0
    if host_gb == 0.0:
        assert engine.counters.recomputations > 0
    else:
        assert engine.counters.offloads > 0
    _no_pages_held(engine)


def test_seeded_sampling_and_penalties_identical_to_the_sync_loop(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    """Seeded draws, top-k/top-p, penalties, min_tokens and logprobs: the same tokens with the
    lag (sampler counters and penalty counts advance at commit, before the next plan)."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.9, top_k=30, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=1.1, top_p=0.8, seed=6, ignore_eos=True),
        SamplingParams(
            max_tokens=NEW,
            temperature=0.7,
            seed=7,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=NEW, temperature=0.0, min_tokens=5, stop_token_ids=[4, 5, 6]),
        SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=2, ignore_eos=True),
    ]
    runs = []
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap)
        outs = _run(engine, prompts[: len(params)], params)
        runs.append([_tokens(outs[f"r{i}"]) for i in range(len(params))])
        lps = [lp.token_id for o in outs["r4"] for lp in o.new_logprobs or ()]
        assert lps == _tokens(outs["r4"])
        _no_pages_held(engine)
    assert runs[0] == runs[1]
    assert all(len(t) > 1 for t in runs[1])
