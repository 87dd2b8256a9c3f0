"""The engine's graph path and pre-planning on CPU, on the tiny Llama.

With ``setup_graphs(capture=False)`` every batched-decode step runs exactly the padded
static-buffer forward a CUDA graph records (bucket, slot, pad rows on the sink page), eagerly;
the greedy tokens must equal the plain eager engine's, and a padded step must write nothing but
the real rows' slots and the sink page. Pre-planning on or off must not change any token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from models import TINY_VOCAB

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import KV, SAMPLER
from mstar.engine.resources.kv import SINK_PAGE
from mstar.engine.sampling_params import SamplingParams

PROMPTS = [
    [3 + (i * 11 + j * 5) % (TINY_VOCAB - 3) for j in range(n)]
    for i, n in enumerate([2, 6, 9, 13, 5])
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
SIZES = (1, 2, 4, 8)


def _engine(folder: Path, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(
        model=str(folder), dtype="float32", device="cpu", page_size=4, num_pages=128
    )
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]


def _with_padded_graph_path(engine: LLMEngine) -> LLMEngine:
    assert engine.model_runner.graphs is None  # CPU: no capture
    why = engine.model_runner.setup_graphs(SIZES, False, engine.max_model_len, capture=False)
    assert why is None and engine.model_runner.graphs is not None
    return engine


def test_padded_graph_path_matches_eager_tokens(tiny_llama_dir: Path) -> None:
    eager = _engine(tiny_llama_dir, enable_preplan=False)
    expected = eager.generate(PROMPTS, [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY])
    padded = _with_padded_graph_path(_engine(tiny_llama_dir))
    got = padded.generate(PROMPTS, [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY])
    assert got == expected
    graphs = padded.model_runner.graphs
    assert graphs is not None and graphs.eager_runs > 0 and graphs.replays == 0
    padded.kv.assert_pages_conserved()


def test_padded_rows_write_only_the_sink_page(tiny_llama_dir: Path) -> None:
    # Driven step by step below: the synchronous loop leaves nothing in flight between steps.
    engine = _with_padded_graph_path(_engine(tiny_llama_dir, async_scheduling="off"))
    for i, prompt in enumerate(PROMPTS[:3]):  # 3 rows -> bucket 4, one pad row
        engine.add_request(f"r{i}", prompt, GREEDY)
    while any(
        r.num_uncomputed != 1 or r.num_computed == 0 for r in engine.scheduler.requests.values()
    ):
        engine.step()
    kv = engine.kv
    before = kv.cache.tensor.clone()
    batch = engine.scheduler.schedule()
    assert batch is not None
    lease = batch.step.ctx.slot_lease
    assert lease is not None and lease.bucket is not None and lease.bucket.bs == 4
    assert list(batch.step.ctx.padded_request_ids)[3].startswith("__pad")
    result = engine.model_runner.execute(batch)
    engine.scheduler.update(batch, result)
    ps = kv.page_size
    # cache [layers, pages, 2, page_size, heads, dim] -> changed [pages, page_size]
    changed = (kv.cache.tensor != before).permute(1, 3, 0, 2, 4, 5).flatten(2).any(dim=2)
    touched = {(int(p), int(o)) for p, o in changed.nonzero().tolist()}
    slots = batch.step.ctx.plan_results[KV].write_slots.tolist()  # the real rows' tokens
    real = {(s // ps, s % ps) for s in slots}
    assert len(real) == 3 and SINK_PAGE not in {p for p, _ in real}
    assert real <= touched
    assert touched - real <= {(SINK_PAGE, 0)}


def test_preplan_on_and_off_give_identical_tokens(tiny_llama_dir: Path) -> None:
    params = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY]
    off = _engine(tiny_llama_dir, enable_preplan=False)
    on = _engine(tiny_llama_dir, enable_preplan=True)
    assert off.generate(PROMPTS, params) == on.generate(PROMPTS, params)
    sampler_on = on.runner.resources[SAMPLER]
    sampler_off = off.runner.resources[SAMPLER]
    assert on.model_runner.preplans > 0
    assert sampler_on.promotions > 0  # type: ignore[attr-defined]
    assert sampler_off.promotions == 0  # type: ignore[attr-defined]
    # Requests finishing changed the rows: some stages were cleared, not promoted.
    assert sampler_on.promotions < on.model_runner.preplans  # type: ignore[attr-defined]
    assert torch.equal(torch.tensor(on.kv.num_free_pages), torch.tensor(off.kv.num_free_pages))


def test_only_batched_decode_within_the_largest_bucket_takes_the_graph_path(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir)
    why = engine.model_runner.setup_graphs((1, 2), False, engine.max_model_len, capture=False)
    assert why is None
    graphs = engine.model_runner.graphs
    assert graphs is not None
    kinds: list[tuple[bool, int, bool]] = []
    execute = engine.model_runner.execute

    def recording(batch, *prev):  # type: ignore[no-untyped-def]
        decode = len(batch.sample_rows) == len(batch.rows) and all(
            r.num_tokens == 1 for r in batch.rows
        )
        before = graphs.eager_runs
        result = execute(batch, *prev)
        kinds.append((decode, len(batch.rows), graphs.eager_runs > before))
        return result

    engine.model_runner.execute = recording  # type: ignore[method-assign]
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    engine.generate(PROMPTS, [short, short, short, long, long])
    assert {(d and n <= 2) for d, n, _ in kinds} == {True, False}  # both kinds happened
    for decode, rows, padded in kinds:
        assert padded == (decode and rows <= 2), (decode, rows, padded)
