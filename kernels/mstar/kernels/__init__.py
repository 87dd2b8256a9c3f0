"""Attention and KV-cache kernels: torch on CPU, FlashInfer on CUDA.

Importing this package never imports flashinfer; ``select_attention_backend`` does, on CUDA only.
"""

from __future__ import annotations

import logging

import torch

from mstar.kernels.flashinfer_backend import (
    FLASHINFER_DTYPES,
    FlashInferGraphDecode,
    FlashInferPagedAttention,
    flashinfer_available,
)
from mstar.kernels.kv_write import slot_rows, write_kv
from mstar.kernels.paged_attention import (
    PagedAttentionBackend,
    TorchPagedAttention,
    kv_lengths,
    validate_plan,
)

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The attention backend asked for cannot run here; the engine refuses to start."""


def resolve_attention_backend(
    choice: str, device: torch.device | str, dtype: torch.dtype, *, available: bool | None = None
) -> str:
    """``torch`` or ``flashinfer`` for this device and dtype; raises rather than fall back.

    ``auto`` takes FlashInfer on CUDA for bf16/fp16 when it is importable, torch otherwise
    (float32 always: FlashInfer has no float32 kernels), and logs what it chose and why.
    """
    dev = torch.device(device)
    have = flashinfer_available() if available is None else available
    if choice == "torch":
        return "torch"
    if choice == "flashinfer":
        if dev.type != "cuda":
            raise BackendUnavailable("--attention-backend flashinfer needs a CUDA device")
        if not have:
            raise BackendUnavailable(
                "--attention-backend flashinfer was asked for but the flashinfer package is not "
                "importable (install flashinfer-python, or use --attention-backend torch)"
            )
        if dtype not in FLASHINFER_DTYPES:
            raise BackendUnavailable(
                f"--attention-backend flashinfer has no {dtype} kernels (bfloat16/float16 only)"
            )
        return "flashinfer"
    if choice != "auto":
        raise ValueError(f"unknown attention backend {choice!r}")
    if dev.type == "cuda" and have and dtype in FLASHINFER_DTYPES:
        chosen, why = "flashinfer", "CUDA, flashinfer importable"
    elif dev.type != "cuda":
        chosen, why = "torch", "not a CUDA device"
    elif not have:
        chosen, why = "torch", "flashinfer is not installed"
    else:
        chosen, why = "torch", f"FlashInfer has no {dtype} kernels"
    log.info("attention backend auto -> %s (%s, dtype %s)", chosen, why, dtype)
    return chosen


def select_attention_backend(
    device: torch.device | str,
    choice: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    *,
    deterministic: bool = False,
) -> PagedAttentionBackend:
    """The backend `resolve_attention_backend` names, built for ``device`` and ``dtype``
    (``deterministic``: in its batch-invariant configuration)."""
    dev = torch.device(device)
    if resolve_attention_backend(choice, dev, dtype) == "flashinfer":
        return FlashInferPagedAttention(dev, dtype, deterministic=deterministic)
    return TorchPagedAttention(dev, deterministic=deterministic)


__all__ = [
    "FLASHINFER_DTYPES",
    "BackendUnavailable",
    "FlashInferGraphDecode",
    "FlashInferPagedAttention",
    "PagedAttentionBackend",
    "TorchPagedAttention",
    "flashinfer_available",
    "kv_lengths",
    "resolve_attention_backend",
    "select_attention_backend",
    "slot_rows",
    "validate_plan",
    "write_kv",
]
