"""``--deterministic``: refuse what cannot be batch-invariant, and set the process up for it.

The numerics themselves live with the kernels (`PackedLinear`, `TorchPagedAttention`,
`FlashInferPagedAttention`, `Decoder`); this module only decides up front, before any weight is
loaded, whether this device and dtype can run them, so a refusal names the flag to change.
"""

from __future__ import annotations

import os

import torch

from mstar.kernels import BackendUnavailable, cpu_kernels
from mstar.kernels.cpu_gemm import deterministic_kernel

#: cuBLAS's documented setting for deterministic results run to run (a fixed workspace per
#: stream; torch's deterministic algorithms refuse cuBLAS calls without it).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


class DeterministicUnavailable(BackendUnavailable):
    """``--deterministic`` cannot run on this device, dtype or backend: the engine refuses to
    start (``mstar-engine serve`` exits 2 with this message), as for a missing backend."""


def deterministic_setup(device: torch.device, dtype: torch.dtype, attention_backend: str) -> None:
    """Raise `DeterministicUnavailable` when this device, dtype and backend cannot run
    deterministically; on
    CUDA, switch torch and cuBLAS to their deterministic algorithms (process-wide)."""
    if device.type == "cpu":
        if dtype != torch.bfloat16:
            raise DeterministicUnavailable(
                f"--deterministic on CPU runs bf16 kernels only (dtype here: {dtype}); "
                "use --dtype bfloat16"
            )
        if deterministic_kernel(cpu_kernels.load()) is None:
            raise DeterministicUnavailable(
                "--deterministic on CPU needs the C++ kernels' bf16 GEMM (VDPBF16PS or FMA): "
                "they are switched off (MSTAR_CPU_KERNELS=0), failed to build, or this CPU has "
                "neither"
            )
        return
    if attention_backend != "flashinfer":
        raise DeterministicUnavailable(
            "--deterministic on CUDA needs --attention-backend flashinfer (its split-KV can be "
            "switched off; the torch backend's SDPA kernels cannot be pinned)"
        )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)


def check_head_dim(device: torch.device, head_dim: int) -> None:
    """The CPU attention kernel every position takes is compiled for a few head dims only."""
    if device.type == "cpu" and not cpu_kernels.supports_head_dim(head_dim):
        raise DeterministicUnavailable(
            f"--deterministic on CPU: the attention kernel has no head_dim {head_dim} "
            f"(one of {', '.join(map(str, cpu_kernels.HEAD_DIMS))})"
        )
