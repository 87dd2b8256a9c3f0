"""What the CUDA tests share: skip marks, the head_dim-64 tiny Llama, a bf16 CUDA engine, and
bf16 paged decode cases on CUDA with their torch-backend reference.

``tests/gpu/first_run.sh`` sets ``MSTAR_GPU_REQUIRE_FLASHINFER=1``: there a missing FlashInfer
fails the FlashInfer tests instead of skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import build_tiny_model
from paged_cases import decode_case

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.kernels import TorchPagedAttention, flashinfer_available

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


#: the kernel-level cases' heads (q, kv, head dim) and page size, as ``plan`` takes them
KERNEL_SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def cuda_decode_case(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """A bf16 paged pool on CUDA with one sequence per length, its q rows and CSR plan."""
    s = KERNEL_SHAPE
    pool, _, q, plan = decode_case(
        lens,
        page_size=s["page_size"],
        heads=(s["num_qo_heads"], s["num_kv_heads"], s["head_dim"]),
        seed=seed,
        dtype=torch.bfloat16,
        q_scale=2.0,
    )
    return pool.cuda(), q.cuda(), plan


def torch_attention(pool: torch.Tensor, q: torch.Tensor, plan: tuple) -> torch.Tensor:
    """The torch backend's attention for a `cuda_decode_case` (the reference)."""
    ref = TorchPagedAttention("cuda")
    ref.plan(*plan, **KERNEL_SHAPE)
    return ref.run(q, pool)
