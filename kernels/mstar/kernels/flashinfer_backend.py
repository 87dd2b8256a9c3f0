"""FlashInfer paged attention for CUDA, behind the same plan/run interface as the torch backend.

``flashinfer`` is imported lazily so importing ``mstar.kernels`` on a CPU machine without it
works. The workspace buffer and both wrappers live as long as the backend: FlashInfer's plan
writes its scheduling metadata into that buffer, and reallocating it per step would cost a
cudaMalloc each time. A step whose rows all have one query uses the decode wrapper (its kernels
are tuned for that shape); any other step uses the prefill wrapper, which handles mixed
prefill + decode batches with a causal mask aligned to each sequence's last token.

FlashInfer needs the query/KV dtype at plan time, which the common interface does not carry, so
the real plan happens at the first ``run`` of the step, once, with ``q``'s dtype. float32, which
FlashInfer's kernels do not implement, falls back to the torch backend.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from mstar.kernels.paged_attention import TorchPagedAttention, validate_plan

WORKSPACE_BYTES = 128 * 1024 * 1024
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    """True when the ``flashinfer`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


class FlashInferPagedAttention:
    """Paged attention through FlashInfer's batch prefill / decode wrappers (layout NHD)."""

    def __init__(self, device: torch.device | str = "cuda", workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer  # lazy: CUDA-only dependency

        self.device = torch.device(device)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True
        )
        self._fallback = TorchPagedAttention(self.device)
        self._args: dict[str, Any] = {}
        self._planned_dtype: torch.dtype | None = None
        self._use_decode = False
        self._fallback_planned = False
        self._num_tokens = 0

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool = True,
    ) -> None:
        """Record this step's layout; FlashInfer's own plan runs at the first ``run``."""
        validate_plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        qo = qo_indptr.to(torch.int32).cpu()
        q_lens = qo[1:] - qo[:-1]
        self._num_tokens = int(qo[-1]) if qo.numel() else 0
        self._use_decode = bool(q_lens.numel()) and bool((q_lens == 1).all())
        self._args = {
            "qo_indptr": qo,
            "kv_indptr": kv_indptr.to(torch.int32).cpu(),
            "kv_indices": kv_indices.to(device=self.device, dtype=torch.int32),
            "kv_last_page_len": kv_last_page_len.to(torch.int32).cpu(),
            "num_qo_heads": num_qo_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "page_size": page_size,
            "causal": causal,
        }
        self._planned_dtype = None
        self._fallback_planned = False

    def _plan_flashinfer(self, dtype: torch.dtype) -> None:
        a = self._args
        if self._use_decode:
            self._decode.plan(
                a["kv_indptr"],
                a["kv_indices"],
                a["kv_last_page_len"],
                a["num_qo_heads"],
                a["num_kv_heads"],
                a["head_dim"],
                a["page_size"],
                pos_encoding_mode="NONE",
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        else:
            self._prefill.plan(
                a["qo_indptr"],
                a["kv_indptr"],
                a["kv_indices"],
                a["kv_last_page_len"],
                a["num_qo_heads"],
                a["num_kv_heads"],
                a["head_dim"],
                a["page_size"],
                causal=a["causal"],
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        self._planned_dtype = dtype

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention for q [T, Hq, D] against one layer's NHD cache view."""
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned for {self._num_tokens} query rows, got {q.shape[0]}")
        if q.dtype not in _FLASHINFER_DTYPES:
            if not self._fallback_planned:
                a = self._args
                self._fallback.plan(
                    a["qo_indptr"],
                    a["kv_indptr"],
                    a["kv_indices"].cpu(),
                    a["kv_last_page_len"],
                    num_qo_heads=a["num_qo_heads"],
                    num_kv_heads=a["num_kv_heads"],
                    head_dim=a["head_dim"],
                    page_size=a["page_size"],
                    causal=a["causal"],
                )
                self._fallback_planned = True
            return self._fallback.run(q, kv_layer)
        if self._planned_dtype != q.dtype:
            self._plan_flashinfer(q.dtype)
        wrapper = self._decode if self._use_decode else self._prefill
        out: torch.Tensor = wrapper.run(q, kv_layer)
        return out
