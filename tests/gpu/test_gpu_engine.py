"""The GPU engine end to end (skipped without CUDA): CUDA graphs against FlashInfer eager
token for token, FlashInfer against the torch backend until a near-tie, graph replay against its
eager twin per bucket, sink-only padding writes, and float32 torch against transformers.

``tests/gpu/first_run.sh`` sets ``MSTAR_GPU_REQUIRE_FLASHINFER=1``: there a missing FlashInfer
fails these tests instead of skipping them.

bf16 comparisons: graphs and eager FlashInfer run the same kernels on the same batches, so
their greedy tokens must be identical. FlashInfer and the torch backend round differently
(both keep attention scores in float32, but sum in other orders), so there the tokens must agree
until the reference's first near-tie and the log-probabilities within `greedy_compare`'s
tolerance; a random model's greedy choices can be nearly tied, so asking for identical tokens
there would fail a correct engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_testing import build_hd64_llama, cuda_engine, needs_cuda, needs_flashinfer
from greedy_compare import assert_close_until_near_tie, drive, top2_gap
from models import hf_greedy

from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import ATTN, KV, ROPE
from mstar.engine.resources.kv import SINK_PAGE
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import FlashInferPagedAttention

pytestmark = needs_cuda
needs_fi = needs_flashinfer

SIZES = [1, 2, 4, 8, 16, 32, 64]
PROMPTS = [
    [3 + (i * 7 + j * 3) % 90 for j in range(n)] for i, n in enumerate([1, 5, 9, 17, 30, 40, 3, 12])
]
NEW = 24
GREEDY_LP = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hd64_llama(tmp_path_factory.mktemp("gpu-llama"))


_engine = cuda_engine


def _fi_engine(folder: Path, **kw: object) -> LLMEngine:
    return _engine(folder, attention_backend="flashinfer", cuda_graph_batch_sizes=SIZES, **kw)


def test_float32_torch_matches_transformers(model_dir: Path) -> None:
    engine = _engine(model_dir, dtype="float32", attention_backend="torch")
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS, greedy) == hf_greedy(model_dir, PROMPTS, NEW)


@needs_fi
def test_bf16_graphs_match_flashinfer_eager_token_for_token(model_dir: Path) -> None:
    eager = _engine(model_dir, attention_backend="flashinfer", enforce_eager=True)
    fast = _fi_engine(model_dir)
    graphs = fast.model_runner.graphs
    assert eager.model_runner.graphs is None
    assert graphs is not None and graphs.num_graphs == 2 * len(SIZES)
    ref_toks, ref_lps = drive(eager, PROMPTS, GREEDY_LP)
    toks, lps = drive(fast, PROMPTS, GREEDY_LP)
    for i, (a, b) in enumerate(zip(ref_toks, toks, strict=True)):
        if a != b:
            t = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            gap = top2_gap(ref_lps[i][t])
            pytest.fail(f"prompt {i} diverges at token {t}; eager top-2 logprob gap {gap:.4f}")
    drift = max(
        abs(x.logprob - y.logprob)
        for ra, rb in zip(ref_lps, lps, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )
    print(f"bf16 flashinfer graphs vs eager: max |dlogprob| = {drift:.2e}")
    eager_backend = eager.runner.resources[ATTN].backend  # type: ignore[attr-defined]
    assert isinstance(eager_backend, FlashInferPagedAttention) and eager_backend.runs > 0
    assert graphs.replays > 0


@needs_fi
def test_bf16_flashinfer_matches_torch_until_a_near_tie(model_dir: Path) -> None:
    ref = _engine(model_dir, attention_backend="torch", enforce_eager=True)
    fast = _fi_engine(model_dir)
    compared, worst = assert_close_until_near_tie(
        drive(ref, PROMPTS, GREEDY_LP), drive(fast, PROMPTS, GREEDY_LP)
    )
    print(f"bf16 flashinfer vs torch: {compared} tokens compared, max |dlogprob| = {worst:.4f}")
    assert compared >= len(PROMPTS) * NEW // 2
    backend = fast.runner.resources[ATTN].backend  # type: ignore[attr-defined]
    graphs = fast.model_runner.graphs
    assert isinstance(backend, FlashInferPagedAttention) and backend.runs > 0
    assert graphs is not None and graphs.replays > 0


def _decoding_batch(engine: LLMEngine, n: int, tag: str):  # type: ignore[no-untyped-def]
    """Admit ``n`` short requests, prefill them, and schedule their next (decode) step (the
    engine runs the synchronous loop: nothing is in flight between its steps)."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{tag}{i}", [5 + (i * 13) % 80, 7, 9 + i % 50], params)
    while any(r.num_computed == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and len(batch.rows) == n
    return batch


@needs_fi
def test_graph_replay_equals_eager_for_every_bucket(model_dir: Path) -> None:
    engine = _fi_engine(model_dir, async_scheduling="off")  # driven by hand
    graphs = engine.model_runner.graphs
    assert graphs is not None
    for bs in SIZES:
        for rows in sorted({bs, max(1, bs - 1)}):  # full, and padded by one row
            batch = _decoding_batch(engine, rows, f"b{bs}r{rows}.")
            lease = batch.step.ctx.slot_lease
            assert lease is not None and lease.bucket is not None and lease.bucket.bs >= rows
            plans = engine.runner.plan(batch.step)
            ids = torch.tensor(
                [r.request.tokens_to_compute(1)[0] for r in batch.rows], device="cuda"
            )
            with torch.inference_mode():
                replayed = graphs.run(lease, ids, plans[ROPE], plans[ATTN]).clone()
                eager = graphs.static_forward(lease, plans[ROPE], plans[ATTN])[:rows]
            torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
            engine.runner.abort_step(batch.step)
            for r in batch.rows:
                engine.abort_request(r.request.request_id)
            engine.step()
            engine.kv.assert_pages_conserved()


@needs_fi
def test_padded_graph_rows_write_only_the_sink_page(model_dir: Path) -> None:
    engine = _fi_engine(model_dir, async_scheduling="off")  # driven by hand
    batch = _decoding_batch(engine, 3, "s")  # bucket 4: one pad row
    lease = batch.step.ctx.slot_lease
    assert lease is not None and lease.bucket is not None and lease.bucket.bs == 4
    kv = engine.kv
    before = kv.cache.tensor.clone()
    engine.scheduler.update(batch, engine.model_runner.execute(batch))
    changed = (kv.cache.tensor != before).permute(1, 3, 0, 2, 4, 5).flatten(2).any(dim=2)
    touched = {(int(p), int(o)) for p, o in changed.nonzero().tolist()}
    ps = kv.page_size
    real = {(s // ps, s % ps) for s in batch.step.ctx.plan_results[KV].write_slots.tolist()}
    assert real <= touched and touched - real <= {(SINK_PAGE, 0)}
    assert engine.model_runner.graphs.replays == 1  # type: ignore[union-attr]
