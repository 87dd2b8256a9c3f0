"""The engine with its KV cache, sampler and attention on a CUDA device (skipped without one).

float32 uses the torch attention backend (FlashInfer has no float32 kernels), so greedy output
must still equal transformers'; bfloat16 takes FlashInfer when it is installed. Both run with a
tiny pool so offload to pinned host memory, reload and recomputation happen on the device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import build_tiny_model, hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 (hidden 256 over 4 heads): a size FlashInfer's kernels are built for."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hd64"), "llama", hidden_size=256)


PROMPTS = [[3 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate([1, 5, 9, 17, 30, 40])]
#: float32 bytes of one 4-token page: 2 layers x K/V x 4 tokens x 2 KV heads x 64 dims x 4 B
PAGE_BYTES = 2 * 2 * 4 * 2 * 64 * 4
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _engine(folder: Path, dtype: str, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(model=str(folder), dtype=dtype, device="cuda", page_size=4)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]


def test_cuda_float32_greedy_matches_transformers_under_evictions(tiny_llama_dir: Path) -> None:
    reference = hf_greedy(tiny_llama_dir, PROMPTS, 20)
    roomy = _engine(tiny_llama_dir, "float32", num_pages=256)
    assert roomy.kv.cache.tensor.is_cuda
    assert roomy.generate(PROMPTS, GREEDY) == reference
    tight = _engine(
        tiny_llama_dir, "float32", num_pages=25, host_offload_gb=16 * PAGE_BYTES / 2**30
    )
    assert tight.generate(PROMPTS, GREEDY) == reference
    assert tight.counters.offloads > 0 and tight.counters.reloads > 0
    tight.kv.assert_pages_conserved()
    assert tight.kv.num_host_pages_used == 0


def test_cuda_bfloat16_runs_mixed_batches_with_evictions(tiny_llama_dir: Path) -> None:
    engine = _engine(
        tiny_llama_dir, "bfloat16", num_pages=25, host_offload_gb=16 * PAGE_BYTES / 2 / 2**30
    )
    backend = type(engine.runner.resources["attn"].backend).__name__  # type: ignore[attr-defined]
    print(f"attention backend: {backend}")
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    outs = engine.generate(PROMPTS, [GREEDY, sampled] * 3)
    assert all(len(o) == 20 for o in outs)
    assert engine.counters.admit_failures > 0
    engine.kv.assert_pages_conserved()
    assert engine.kv.num_host_pages_used == 0
