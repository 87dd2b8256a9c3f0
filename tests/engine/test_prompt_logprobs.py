"""Prompt logprobs (`SamplingParams.prompt_logprobs`) on the tiny Llama: every prompt token's
logprob, rank and top alternatives equal transformers' log-softmax over the prompt (float32,
1e-4), in one prefill, across chunks, after a prefix-cache hit and under eviction."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from models import TINY_VOCAB

from mstar.engine import scheduler as scheduler_module
from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.outputs import RequestOutput, TokenLogprob
from mstar.engine.sampling_params import InvalidParameter, SamplingParams

TOP = 3
TOL = 1e-4


def _engine(folder: Path, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(
        model=str(folder), dtype="float32", device="cpu", page_size=4, seed=0, num_pages=256
    )
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]


def _prompts(n: int, seed: int = 11, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(3, TINY_VOCAB) for _ in range(shared)]
    return [
        head + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(n)
    ]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return run


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    """Every output of each prompt's request, in prompt order."""
    ids = [f"p{i}-{engine.scheduler.step_index}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [o for rid in ids for o in outs[rid]]


def _scores(outputs: list[RequestOutput], n: int) -> list[list[TokenLogprob]]:
    delivered = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(delivered) == n  # once per request
    return delivered  # type: ignore[return-value]


def _check(prompt: list[int], scores: list[TokenLogprob], ref: torch.Tensor) -> None:
    assert [s.token_id for s in scores] == prompt[1:]
    for pos, s in enumerate(scores):  # position pos scores token pos + 1
        row = ref[pos]
        assert s.logprob == pytest.approx(float(row[prompt[pos + 1]]), abs=TOL)
        # Rank and top-k order are exact up to near-ties (a random tiny model has many).
        want = row[prompt[pos + 1]]
        assert 1 + int((row > want + TOL).sum()) <= s.rank <= 1 + int((row > want - TOL).sum())
        assert [v for _, v in s.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=TOL)
        assert [float(row[t]) for t, _ in s.top] == pytest.approx([v for _, v in s.top], abs=TOL)


SCORED = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


def test_prompt_logprobs_equal_transformers(tiny_llama_dir: Path, hf_logprobs) -> None:
    engine = _engine(tiny_llama_dir)
    prompts = [*_prompts(6), [5]]  # a one-token prompt has nothing to score
    scores = _scores(_run(engine, prompts, SCORED), len(prompts))
    for prompt, got in zip(prompts, scores, strict=True):
        _check(prompt, got, hf_logprobs(prompt))
    assert scores[-1] == []


def test_chunked_prefill_and_the_scored_row_cap(
    tiny_llama_dir: Path,
    hf_logprobs,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of 8 tokens, and at most 5 scored positions a step: scores still land in order,
    once each."""
    monkeypatch.setattr(scheduler_module, "MAX_SCORED_ROWS", 5)
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=3)
    prompts = _prompts(5, seed=3)
    scores = _scores(_run(engine, prompts, SCORED), len(prompts))
    for prompt, got in zip(prompts, scores, strict=True):
        _check(prompt, got, hf_logprobs(prompt))


def test_a_cached_prefix_is_still_scored(tiny_llama_dir: Path, hf_logprobs) -> None:
    """The prefix is cached by an unscored request first; the scored one reads none of it (its
    positions must run to have logits), and the pages it fills serve the next request."""
    engine = _engine(tiny_llama_dir)
    prompts = _prompts(3, seed=5, shared=24)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run(engine, prompts[:1], plain)
    hits = engine.kv.prefix_hits
    assert engine.kv.probe_prefix(prompts[1]) >= 24 - 4  # the shared pages are cached
    scores = _scores(_run(engine, prompts[1:2], SCORED), 1)
    _check(prompts[1], scores[0], hf_logprobs(prompts[1]))
    assert engine.kv.prefix_hits == hits  # scored: nothing matched
    out = _run(engine, prompts[2:], plain)
    assert out[-1].num_cached_tokens >= 20  # the next unscored request still hits
    after = _scores(_run(engine, prompts[1:2], SCORED), 1)  # and a repeat scores the same
    assert after == scores


def test_eviction_and_recompute_score_each_token_once(
    tiny_llama_dir: Path,
    hf_logprobs,
) -> None:
    """A pool too small for the batch: victims are offloaded or recomputed; a recomputed prefill
    scores nothing twice and every score matches."""
    engine = _engine(tiny_llama_dir, num_pages=41, host_offload_gb=12 * 2048 / 2**30)
    prompts = _prompts(16, seed=7, shared=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = _run(engine, prompts, params)
    c = engine.counters
    assert c.recomputations > 0 and c.offloads > 0
    scores = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(scores) == len(prompts)
    for prompt, got in zip(prompts, scores, strict=True):
        ref = hf_logprobs(prompt)
        assert [s.token_id for s in got] == prompt[1:]
        want = [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert [s.logprob for s in got] == pytest.approx(want, abs=TOL)
    engine.kv.wait_copies()
    engine.kv.assert_pages_conserved()


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"


@pytest.mark.slow
def test_smollm2_prompt_logprobs_equal_transformers() -> None:
    """The real model, float32, prefilled in 16-token chunks (measured: 8e-6 at most)."""
    import transformers

    from mstar.engine.model.gguf_convert import default_model_path

    path = default_model_path()
    engine = _engine(path, page_size=16, max_num_batched_tokens=16)
    text = "The capital of France is Paris. The capital of Italy is Rome, and of Spain, Madrid."
    ids = engine.tokenizer.encode(text)
    (scores,) = _scores(_run(engine, [ids], SCORED), 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert [s.logprob for s in scores] == pytest.approx(want, abs=TOL)
    assert [s.token_id for s in scores] == ids[1:]
