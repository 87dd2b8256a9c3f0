"""``--deterministic`` on the real model (SmolLM2-135M, bf16, CPU kernels): a request's tokens
and log-probabilities are the same bits alone, in a batch of 32, chunked by a 64-token step
budget, after a prefix-cache hit, and on a pool so small that requests are offloaded and
recomputed; greedy and seeded. (Without the flag these differ today: see the kernels README.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from models import QUESTIONS

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.sampling_params import SamplingParams

NEW_TOKENS = 24
PARAMS = {
    "greedy": SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
    "seeded": SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True, logprobs=0
    ),
}
#: one SmolLM2 KV page of 16 tokens in bf16: 30 layers x K/V x 16 x 3 heads x 64 dims x 2 bytes
PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 2

Result = tuple[list[int], list[float]]
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    """32 chat prompts of 31-87 tokens; they share the template's system prefix (pages long)."""
    tok = Tokenizer.from_dir(model_dir)
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q * (1 + i % 3)}]))
        for i, q in enumerate(QUESTIONS * 4)
    ]


def engine(model_dir: Path, **settings: object) -> LLMEngine:
    base: dict[str, object] = dict(num_pages=1024, enable_prefix_caching=False)
    base.update(settings)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", device="cpu", deterministic=True, **base
    )  # type: ignore[arg-type]
    return LLMEngine.from_config(config)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Result]:
    """Each prompt's (tokens, log-probabilities of the chosen tokens), in prompt order."""
    ids = [f"r{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        eng.add_request(rid, prompt, params)
    out: dict[str, Result] = {rid: ([], []) for rid in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or [])
    return [out[rid] for rid in ids]


@pytest.fixture(scope="module", params=sorted(PARAMS))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def alone(model_dir: Path, prompts: list[list[int]], mode: str) -> Result:
    """The 87-token prompt alone, unchunked (budget 2048), no prefix cache: the reference."""
    target = prompts[11]
    assert len(target) > 64  # so a 64-token budget chunks it
    (result,) = run(engine(model_dir), [target], PARAMS[mode])
    assert len(result[0]) == len(result[1]) == NEW_TOKENS
    return result


def test_alone_equals_inside_a_batch_of_32(
    model_dir: Path, prompts: list[list[int]], mode: str, alone: Result
) -> None:
    batch = run(engine(model_dir), [prompts[11], *prompts[:31]], PARAMS[mode])
    assert batch[0] == alone


def test_chunked_by_a_64_token_budget_equals_unchunked(
    model_dir: Path, prompts: list[list[int]], mode: str, alone: Result
) -> None:
    eng = engine(model_dir, max_num_batched_tokens=64)
    chunked = run(eng, [prompts[11], *prompts[:7]], PARAMS[mode])
    assert chunked[0] == alone


def test_prefix_cache_hit_equals_a_cold_run(
    model_dir: Path, prompts: list[list[int]], mode: str, alone: Result
) -> None:
    eng = engine(model_dir, enable_prefix_caching=True)
    run(eng, [prompts[0]], PARAMS[mode])  # caches the chat template's shared prefix
    hits = eng.stats().prefix_hits
    assert run(eng, [prompts[11]], PARAMS[mode])[0] == alone
    assert eng.stats().prefix_hits > hits


def test_tiny_pool_with_offload_and_recompute_equals_a_roomy_pool(
    model_dir: Path, prompts: list[list[int]], mode: str
) -> None:
    """24 usable pages of 16 tokens for 16 requests of 55-111 tokens: with 6 host pages victims
    are offloaded and reloaded, with none they are recomputed (how many of each a run makes
    depends on timing, so each pool forces one kind)."""
    roomy = run(engine(model_dir), prompts[:16], PARAMS[mode])
    offload = engine(model_dir, num_pages=25, host_offload_gb=6 * PAGE_BYTES / 2**30)
    assert run(offload, prompts[:16], PARAMS[mode]) == roomy
    assert offload.counters.offloads > 0 and offload.counters.reloads > 0
    recompute = engine(model_dir, num_pages=25, host_offload_gb=0)
    assert run(recompute, prompts[:16], PARAMS[mode]) == roomy
    assert recompute.counters.recomputations > 0
