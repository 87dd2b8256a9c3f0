"""LoRA inside the captured CUDA decode graph (issue 49; skipped without CUDA).

An engine serving adapters now captures its decode graphs (before, LoRA turned them off): the
graph's static per-slot buffers hold each row's adapter slot, and the adapters' stacked weights
are written in place. Here: the same batch of adapter and base rows gives the same bf16 tokens
with graphs as with ``--enforce-eager`` (the gathered eager form), a replay equals its eager
twin for a mixed step, and a slot reloaded in place changes the replay's output (the captured
pointers read the new weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_testing import build_hd64_llama, cuda_engine, needs_cuda, needs_flashinfer
from lora_adapters import ALL_PROJECTIONS, build_adapter

from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import ATTN, LORA, ROPE
from mstar.engine.sampling_params import SamplingParams

pytestmark = [needs_cuda, needs_flashinfer]

SIZES = [1, 2, 4, 8]
NAMES = ["a8", "a64"]
PROMPTS = [[3 + (i * 7 + j * 3) % 90 for j in range(3 + 4 * i)] for i in range(6)]
LORAS: list[str | None] = ["a8", None, "a64", "a8", None, "a64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hd64_llama(tmp_path_factory.mktemp("gpu-lora-llama"))


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-lora")
    return {n: build_adapter(model_dir, root / n, int(n[1:]), 7 + i, ALL_PROJECTIONS)
            for i, n in enumerate(NAMES)}  # fmt: skip


def _engine(model_dir: Path, adapters: dict[str, Path], **kw: object) -> LLMEngine:
    return cuda_engine(
        model_dir, attention_backend="flashinfer", cuda_graph_batch_sizes=SIZES, max_loras=2,
        max_lora_rank=64, lora_modules=[f"{n}={p}" for n, p in adapters.items()], **kw,
    )  # fmt: skip


def _params(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, lora_name=name)


def test_adapter_batches_replay_like_eager(model_dir: Path, adapters: dict[str, Path]) -> None:
    eager = _engine(model_dir, adapters, enforce_eager=True)
    fast = _engine(model_dir, adapters)
    graphs = fast.model_runner.graphs
    assert eager.model_runner.graphs is None
    assert graphs is not None and graphs.num_graphs == 2 * len(SIZES) and graphs.lora is not None
    params = [_params(n) for n in LORAS]
    want = eager.generate(PROMPTS, params)
    assert fast.generate(PROMPTS, params) == want
    assert graphs.replays > 0 and graphs.lora.staged >= graphs.replays
    base = fast.generate(PROMPTS, [_params(None)] * len(PROMPTS))
    assert base != want  # the adapters moved the replayed tokens


def test_replay_equals_eager_and_reads_a_reloaded_slot(
    model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(model_dir, adapters, async_scheduling="off")  # driven by hand
    graphs, lora = engine.model_runner.graphs, engine.lora
    assert graphs is not None and lora is not None
    for name in NAMES:  # both adapters resident
        engine.generate([[5]], SamplingParams(max_tokens=1, lora_name=name))
    params = [_params(n) for n in LORAS[:3]]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5 + i, 7, 9], p)
    while any(r.num_computed == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and len(batch.rows) == 3
    lease = batch.step.ctx.slot_lease
    assert lease is not None and lease.bucket is not None and lease.bucket.bs == 4
    plans = engine.runner.plan(batch.step)
    ids = torch.tensor([r.request.tokens_to_compute(1)[0] for r in batch.rows], device="cuda")
    with torch.inference_mode():
        replayed = graphs.run(lease, ids, plans[ROPE], plans[ATTN], plans.get(LORA)).clone()
        eager = graphs.static_forward(lease, plans[ROPE], plans[ATTN])[:3].clone()
        torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
        slot = lora.pool.slot("a8")
        lora.write(slot, None)  # a8's slot cleared in place: row 0 runs as the base now
        cleared = graphs.run(lease, ids, plans[ROPE], plans[ATTN], plans.get(LORA)).clone()
    torch.testing.assert_close(cleared[1:], replayed[1:], atol=1e-3, rtol=1e-3)  # base, a64
    assert not torch.allclose(cleared[0], replayed[0], atol=1e-2)  # a8's row lost its update
