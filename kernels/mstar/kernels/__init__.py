"""Attention and KV-cache kernels: torch on CPU, FlashInfer on CUDA.

Importing this package never imports flashinfer; ``select_attention_backend`` does, on CUDA only.
"""

from __future__ import annotations

import torch

from mstar.kernels.flashinfer_backend import FlashInferPagedAttention, flashinfer_available
from mstar.kernels.kv_write import slot_rows, write_kv
from mstar.kernels.paged_attention import (
    PagedAttentionBackend,
    TorchPagedAttention,
    kv_lengths,
    validate_plan,
)


def select_attention_backend(device: torch.device | str) -> PagedAttentionBackend:
    """FlashInfer on CUDA when it is importable, else the torch implementation."""
    dev = torch.device(device)
    if dev.type == "cuda" and flashinfer_available():
        return FlashInferPagedAttention(dev)
    return TorchPagedAttention(dev)


__all__ = [
    "FlashInferPagedAttention",
    "PagedAttentionBackend",
    "TorchPagedAttention",
    "flashinfer_available",
    "kv_lengths",
    "select_attention_backend",
    "slot_rows",
    "validate_plan",
    "write_kv",
]
