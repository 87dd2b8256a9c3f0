"""The engine with its KV cache, sampler and attention on a CUDA device (skipped without one).

float32 runs the torch attention backend (FlashInfer has no float32 kernels), so greedy output
must equal transformers'. bfloat16 with ``--attention-backend flashinfer`` and CUDA graphs must
agree with the eager torch backend until a near-tie (`greedy_compare`: the two round
differently, so identical tokens are not a correct engine's promise), with FlashInfer's kernel
calls and graph replays counted so a silent fallback fails. Both run with a tiny pool so
offload to pinned host memory, reload and recomputation happen on the device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from greedy_compare import assert_close_until_near_tie, drive
from models import build_tiny_model, hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import ATTN
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import FlashInferPagedAttention, flashinfer_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: tests/gpu/first_run.sh sets it: there a missing FlashInfer is a failure, not a skip.
REQUIRE_FI = os.environ.get("MSTAR_GPU_REQUIRE_FLASHINFER") == "1"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 (hidden 256 over 4 heads): a size FlashInfer's kernels are built for. A wide
    init keeps greedy choices away from near-ties, which bf16 rounding could flip."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-hd64"),
        "llama",
        hidden_size=256,
        initializer_range=0.2,
    )


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


@pytest.mark.skipif(not (flashinfer_available() or REQUIRE_FI), reason="needs flashinfer")
def test_cuda_bfloat16_flashinfer_graphs_close_to_eager_torch_under_evictions(
    tiny_llama_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    reference = drive(
        _engine(
            tiny_llama_dir, "bfloat16", num_pages=256, attention_backend="torch", enforce_eager=True
        ),
        PROMPTS,
        params,
    )
    engine = _engine(
        tiny_llama_dir,
        "bfloat16",
        num_pages=25,
        host_offload_gb=16 * PAGE_BYTES / 2 / 2**30,
        attention_backend="flashinfer",
    )
    backend = engine.runner.resources[ATTN].backend  # type: ignore[attr-defined]
    assert isinstance(backend, FlashInferPagedAttention)
    graphs = engine.model_runner.graphs
    assert graphs is not None and graphs.num_graphs > 0
    compared, worst = assert_close_until_near_tie(reference, drive(engine, PROMPTS, params))
    print(f"{compared} tokens compared, max |dlogprob| {worst:.4f}")
    assert compared >= len(PROMPTS) * 20 // 2
    # FlashInfer served the eager (prefill/mixed) steps and the graphs the decode steps.
    assert backend.runs > 0 and graphs.replays > 0
    assert engine.counters.admit_failures > 0
    engine.kv.assert_pages_conserved()
    assert engine.kv.num_host_pages_used == 0
