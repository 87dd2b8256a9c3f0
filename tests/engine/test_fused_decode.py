"""A decode step's layers in one `cpu_kernels.decode_layers` call: the same bits as the
layer-by-layer path, on every ISA level this CPU runs that has a small-batch GEMM of the
model's dtype (bf16: FMA on x86-64-v3, VDPBF16PS, AMX; float32: FMA on every level from
x86-64-v3), for Llama, Qwen2 (QKV biases), Qwen3 (q/k norm, head_dim 128) and Gemma 3 (q/k
norm, 1 + w sandwich norms, GELU-tanh, 5 sliding-window layers with their own RoPE base and KV
groups beside a full one, windows shorter than the prompts)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from external_tools import require_tool
from fused_compare import compare_fused_steps
from models import TINY_VOCAB, build_tiny_model

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.decoder import FusedDecodeWeights
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import cpu_isa, cpu_kernels

NEW_TOKENS = 12
#: per dtype, the levels whose GEMMs for decode-sized batches are the kernels' own (the fused
#: path's): every level with FMA; the baseline has none
FUSED_LEVELS = {
    "bfloat16": ("x86-64-v3", "x86-64-v4", "avx512-bf16", "amx"),
    "float32": ("x86-64-v3", "x86-64-v4", "avx512-bf16", "amx"),
}


@pytest.fixture(params=[lvl.name for lvl in cpu_isa.supported_levels()])
def level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The engine built at this level (`MSTAR_CPU_ISA`); the loader's choice is forgotten
    after, so later tests load the CPU's own level again."""
    require_tool("g++")
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, request.param)
    cpu_kernels.load.cache_clear()
    yield request.param
    cpu_kernels.load.cache_clear()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A family's tiny random checkpoint (`build_tiny_model`), built once per module."""
    folders: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in folders:
            folders[family] = build_tiny_model(tmp_path_factory.mktemp(family), family)
        return folders[family]

    return folder


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([1, 5, 9, 19]))] for _ in range(n)
    ]


def _engine(folder: Path, dtype: str = "bfloat16") -> LLMEngine:
    """A small pool and no host tier: the page checks the tests run walk every page."""
    config = EngineConfig(
        model=str(folder), dtype=dtype, device="cpu", page_size=4, num_pages=256,
        host_offload_gb=0, seed=0,
    )  # fmt: skip
    return LLMEngine.from_config(config)


@pytest.mark.parametrize("dtype", sorted(FUSED_LEVELS))
@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss"]
)
def test_fused_decode_layers_give_the_layer_by_layer_bits(
    level: str, family: str, dtype: str, tiny_model: Callable[[str], Path]
) -> None:
    engine = _engine(tiny_model(family), dtype)
    decoder = engine.model_runner.decoder
    assert decoder.cpu_kernels is not None and decoder.cpu_kernels.isa_level() == level
    fused_rows = compare_fused_steps(decoder)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # one sequence, then a batch of mixed lengths (prompt chunks beside decode rows: unfused)
    outs = engine.generate(_prompts(1), params) + engine.generate(_prompts(9), params)
    assert [len(o) for o in outs] == [NEW_TOKENS] * 10
    if level in FUSED_LEVELS[dtype]:
        assert isinstance(decoder.fused_decode, FusedDecodeWeights)
        assert 1 in fused_rows and 9 in fused_rows
    else:  # oneDNN runs the GEMMs: the layers go one by one
        assert fused_rows == [] and decoder.fused_decode is None


def test_a_step_past_the_small_batch_rows_goes_layer_by_layer(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    decoder = engine.model_runner.decoder
    bundle = FusedDecodeWeights.gather(decoder.layers)
    if bundle is None:
        pytest.skip("this CPU's best level runs oneDNN's bf16 GEMMs: nothing is fused")
    decoder.fused_decode = bundle
    context = _DecodeOnly()
    assert decoder._fused_layers(context, bundle.max_rows) is not None
    assert decoder._fused_layers(context, bundle.max_rows + 1) is None
    assert decoder._fused_layers(_DecodeOnly(found=False), 1) is None


class _DecodeOnly:
    """A context whose step is (or is not) decode-only on the kernels."""

    def __init__(self, found: bool = True) -> None:
        self.found = found

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        raise AssertionError("not called")

    def kernel_decode(self) -> Any | None:
        return object() if self.found else None
