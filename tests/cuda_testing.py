"""What the CUDA tests share: skip marks, the head_dim-64 tiny Llama, and a bf16 CUDA engine.

``tests/gpu/first_run.sh`` sets ``MSTAR_GPU_REQUIRE_FLASHINFER=1``: there a missing FlashInfer
fails the FlashInfer tests instead of skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import build_tiny_model

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.kernels import flashinfer_available

CUDA = torch.cuda.is_available()
REQUIRE_FI = os.environ.get("MSTAR_GPU_REQUIRE_FLASHINFER") == "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_flashinfer = pytest.mark.skipif(
    CUDA and not flashinfer_available() and not REQUIRE_FI, reason="needs flashinfer"
)


def build_hd64_llama(folder: Path) -> Path:
    """head_dim 64 (hidden 256 over 4 heads, a size FlashInfer's kernels are built for); a wide
    init so greedy choices are rarely near-ties."""
    return build_tiny_model(folder, "llama", hidden_size=256, initializer_range=0.2)


def cuda_engine(folder: Path, **kw: object) -> LLMEngine:
    """A bf16 engine on CUDA over ``folder`` (4-token pages, 512 of them), ``kw`` overriding."""
    cfg: dict[str, object] = dict(
        model=str(folder), dtype="bfloat16", device="cuda", page_size=4, num_pages=512
    )
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))  # type: ignore[arg-type]
