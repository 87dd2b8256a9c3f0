"""Tensor parallelism offline: ``--tensor-parallel-size 2`` (two gloo ranks on this machine's
CPUs) against one rank, float32 greedy, on the model-room families and the real SmolLM2; how
a model is split; what cannot be split is refused by name.

The row-parallel all-reduce sums each rank's partial product, so the float32 additions happen
in another order than one rank's GEMM: tokens must match except where the reference's top two
are nearly tied (`greedy_compare`, with tolerances for float32 reassociation: measured drift on
SmolLM2 1.3e-5 nats over 192 tokens).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_compare import assert_close_until_near_tie, drive
from live_server import make_engine
from models import build_tiny_model, smollm2_prompts

from mstar.engine.engine import LLMEngine
from mstar.engine.model.config import ModelConfig, ModelLoadError
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.model.tp import TPShard, page_kv_heads
from mstar.engine.parallel.group import Layout, RankLayoutError, check_devices
from mstar.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
#: float32 reassociation: the largest drift seen was 1.3e-5; a flip needs a gap below 2x this
LOGPROB_TOL = 1e-3
#: prompts of mixed lengths, past the tiny Gemma 3 and Mistral windows (8) and several pages
PROMPTS = [[1, 5, 9, 33, 12, 7], [1, *range(40, 60)], [1, 3], [1, *range(10, 70, 3)]]


def children() -> set[int]:
    """This test process's child processes (a sharded engine's worker ranks)."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Any:
    try:
        return drive(engine, prompts, params)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        f: build_tiny_model(tmp_path_factory.mktemp(f"tp-{f}"), f)
        for f in ("llama", "qwen3", "gemma3")
    }


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_two_ranks_match_one_on_the_families(family: str, family_dirs: dict[str, Path]) -> None:
    folder = family_dirs[family]
    ref = run(make_engine(folder), PROMPTS, GREEDY)
    sharded = make_engine(folder, tensor_parallel_size=2)
    assert sharded.decoder.config.num_kv_heads == 1  # 2 KV heads: one per rank
    got = run(sharded, PROMPTS, GREEDY)
    compared, drift = assert_close_until_near_tie(
        ref, got, logprob_tol=LOGPROB_TOL, near_tie=2 * LOGPROB_TOL
    )
    assert compared == len(PROMPTS) * GREEDY.max_tokens  # no near-tie divergence either
    assert drift < LOGPROB_TOL


def test_two_ranks_match_one_when_a_small_pool_evicts(family_dirs: dict[str, Path]) -> None:
    """Rank 0 evicts and recomputes on its own page table: the other ranks' pools follow it."""
    folder = family_dirs["llama"]
    small = {"num_pages": 14, "host_offload_gb": 0.0}  # 13 usable pages of 4 tokens, 4 requests
    ref_engine = make_engine(folder, **small)
    ref = run(ref_engine, PROMPTS, GREEDY)
    sharded = make_engine(folder, tensor_parallel_size=2, **small)
    got = run(sharded, PROMPTS, GREEDY)
    assert sharded.counters.evictions > 0 and ref_engine.counters.evictions > 0
    assert_close_until_near_tie(ref, got, logprob_tol=LOGPROB_TOL, near_tie=2 * LOGPROB_TOL)


@pytest.mark.slow
def test_two_ranks_match_one_on_smollm2() -> None:
    """The real model's 3 KV heads split 2 + 1: uneven heads, one page count on both ranks."""
    folder = default_model_path()
    prompts = smollm2_prompts(folder, 3)
    params = dataclasses.replace(GREEDY, max_tokens=24)
    settings = {"model": str(folder), "dtype": "float32", "device": "cpu", "num_pages": None}
    ref = run(make_engine(folder, **settings), prompts, params)
    sharded = make_engine(folder, tensor_parallel_size=2, **settings)
    # Both ranks size pages by rank 0's 2 heads: the count rank 0 admits against holds on 1.
    assert sharded.decoder.config.num_kv_heads == 2
    got = run(sharded, prompts, params)
    compared, _ = assert_close_until_near_tie(
        ref, got, logprob_tol=LOGPROB_TOL, near_tie=2 * LOGPROB_TOL
    )
    assert compared == len(prompts) * params.max_tokens


def smollm2_shape() -> ModelConfig:
    return ModelConfig.from_file(default_model_path())


@pytest.mark.slow
def test_a_model_splits_by_kv_head_groups_and_padded_vocabulary() -> None:
    cfg = smollm2_shape()  # 9 query / 3 KV heads, intermediate 1536, vocab 49152
    ranks = [TPShard(r, 2, cfg) for r in range(2)]
    assert [s.kv_heads for s in ranks] == [(0, 2), (2, 1)]
    assert [s.q_heads for s in ranks] == [(0, 6), (6, 3)]  # each KV head keeps its 3 queries
    assert [s.inter for s in ranks] == [(0, 768), (768, 768)]
    assert page_kv_heads(cfg, 2) == 2
    odd = dataclasses.replace(cfg, vocab_size=49153)
    assert [TPShard(r, 2, odd).vocab for r in range(2)] == [(0, 24577), (24577, 24576)]
    assert TPShard(1, 2, odd).local_config().vocab_size == 24577  # padded to one width


def test_what_cannot_be_split_is_refused_by_name(family_dirs: dict[str, Path]) -> None:
    cfg = ModelConfig.from_file(family_dirs["llama"])  # 2 KV heads
    with pytest.raises(ModelLoadError, match="2 KV heads cannot be split over 4 ranks"):
        TPShard(0, 4, cfg)
    moe = build_tiny_model(family_dirs["llama"].parent / "moe", "qwen3_moe")
    with pytest.raises(ModelLoadError, match="MoE experts are not sharded"):
        TPShard(0, 2, ModelConfig.from_file(moe))
    # The engine refuses it the same way, and leaves no rank behind.
    before = children()
    with pytest.raises(ModelLoadError, match="MoE experts are not sharded"):
        make_engine(moe, tensor_parallel_size=2)
    assert children() <= before


def test_a_pod_with_fewer_gpus_than_its_ranks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before any rank starts (`start_leader`, `serve_node`); one GPU seen here."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RankLayoutError, match="--nnodes 2 runs 2 ranks per pod, one GPU each"):
        check_devices(Layout(4, 2, 1), torch.device("cuda"))
    check_devices(Layout(2, 2, 1), torch.device("cuda"))  # one rank per pod fits
    check_devices(Layout(4, 1, 0), torch.device("cpu"))  # CPU ranks share the cores
