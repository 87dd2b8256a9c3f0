"""FlashInfer paged attention for CUDA, behind the same plan/run interface as the torch backend.

``flashinfer`` is imported lazily so importing ``mstar.kernels`` on a CPU machine without it
works. The backend is built for one dtype (bf16 or fp16: FlashInfer has no float32 kernels, so
asking for float32 raises instead of silently running something else), which lets ``plan`` run
FlashInfer's own plan at once, once per step, from the KV plan's int32 CPU arrays.

Two kinds of wrapper, both over buffers that live as long as the backend (FlashInfer's plan
writes scheduling metadata into its workspace; reallocating per step would cudaMalloc each time):

- `FlashInferPagedAttention`: the eager path. All-decode steps take the decode wrapper (kernels
  tuned for one query per row); any other step the prefill wrapper, whose causal mask is aligned
  to each sequence's last token, so mixed prefill/decode batches are one call.
- `FlashInferGraphDecode`: one per CUDA-graph (bucket, slot). A decode wrapper in FlashInfer's
  CUDA-graph mode over fixed index buffers sized for the bucket, so the addresses a captured graph
  recorded stay valid and each replay only re-plans into them.

``runs`` counts kernel calls, so a test can prove FlashInfer really served a step.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from mstar.kernels.paged_attention import validate_plan

WORKSPACE_BYTES = 128 * 1024 * 1024
#: Per (bucket, slot) graph wrapper: decode's split-KV scratch is far smaller than prefill's.
GRAPH_WORKSPACE_BYTES = 32 * 1024 * 1024
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    """True when the ``flashinfer`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def check_flashinfer_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"FlashInfer attention has no {dtype} kernels (bfloat16 and float16 only); "
            "use --attention-backend torch or --dtype bfloat16"
        )


class _Layout:
    """One step's CSR arrays as FlashInfer's plan takes them (int32, host)."""

    __slots__ = ("kv_indices", "kv_indptr", "last_page_len", "num_tokens", "qo_indptr")

    def __init__(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        page_size: int,
    ) -> None:
        validate_plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        self.qo_indptr = qo_indptr.to(torch.int32).cpu()
        self.kv_indptr = kv_indptr.to(torch.int32).cpu()
        self.kv_indices = kv_indices.to(torch.int32)
        self.last_page_len = kv_last_page_len.to(torch.int32).cpu()
        self.num_tokens = int(self.qo_indptr[-1]) if self.qo_indptr.numel() else 0

    @property
    def all_decode(self) -> bool:
        q_lens = self.qo_indptr[1:] - self.qo_indptr[:-1]
        return bool(q_lens.numel()) and bool((q_lens == 1).all())


class FlashInferPagedAttention:
    """Eager paged attention through FlashInfer's batch prefill / decode wrappers (NHD)."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        check_flashinfer_dtype(dtype)
        import flashinfer  # lazy: CUDA-only dependency

        self.device = torch.device(device)
        self.dtype = dtype
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True
        )
        self._wrapper: Any = None
        self._num_tokens = 0
        #: Device copy of the step's page indices, reused (grown, never shrunk) step to step.
        self._indices = torch.zeros(1024, dtype=torch.int32, device=self.device)
        self.runs = 0
        self.plans = 0

    def _device_indices(self, host: torch.Tensor) -> torch.Tensor:
        n = host.numel()
        if n > self._indices.numel():
            self._indices = torch.zeros(2 * n, dtype=torch.int32, device=self.device)
        view = self._indices[:n]
        view.copy_(host, non_blocking=True)
        return view

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
        """FlashInfer's plan for this step, once; every layer's ``run`` reuses it."""
        lay = _Layout(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        indices = self._device_indices(lay.kv_indices)
        if lay.all_decode:
            self._decode.plan(
                lay.kv_indptr,
                indices,
                lay.last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                pos_encoding_mode="NONE",
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            self._wrapper = self._decode
        else:
            self._prefill.plan(
                lay.qo_indptr,
                lay.kv_indptr,
                indices,
                lay.last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=causal,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            self._wrapper = self._prefill
        self._num_tokens = lay.num_tokens
        self.plans += 1

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention for q [T, Hq, D] against one layer's NHD cache view."""
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned for {self._num_tokens} query rows, got {q.shape[0]}")
        if self._wrapper is None:
            raise RuntimeError("FlashInfer run before plan")
        self.runs += 1
        out: torch.Tensor = self._wrapper.run(q, kv_layer)
        return out

    def graph_decode(self, batch_size: int, max_pages: int) -> FlashInferGraphDecode:
        """A CUDA-graph decode wrapper for one (bucket, slot): ``batch_size`` rows exactly."""
        return FlashInferGraphDecode(self.device, self.dtype, batch_size, max_pages)


class FlashInferGraphDecode:
    """Decode wrapper in CUDA-graph mode: fixed buffers, ``batch_size`` rows every plan."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        batch_size: int,
        max_pages: int,
        workspace_bytes: int = GRAPH_WORKSPACE_BYTES,
    ) -> None:
        check_flashinfer_dtype(dtype)
        import flashinfer

        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        i32 = torch.int32
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._indptr = torch.zeros(batch_size + 1, dtype=i32, device=device)
        self._indices = torch.zeros(max(1, max_pages), dtype=i32, device=device)
        self._last = torch.zeros(batch_size, dtype=i32, device=device)
        self._wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=self._indptr,
            paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last,
        )
        self.runs = 0
        self.plans = 0

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
        lay = _Layout(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        if lay.kv_indptr.numel() - 1 != self.batch_size or not lay.all_decode:
            raise ValueError(
                f"graph decode wrapper takes exactly {self.batch_size} one-token rows, got "
                f"{lay.kv_indptr.numel() - 1}"
            )
        if lay.kv_indices.numel() > self._indices.numel():
            raise ValueError("more KV pages than the graph wrapper's index buffer holds")
        self._wrapper.plan(
            lay.kv_indptr,
            lay.kv_indices.to(self.device, non_blocking=True),
            lay.last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode="NONE",
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self.plans += 1

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        out: torch.Tensor = self._wrapper.run(q, kv_layer)
        return out
