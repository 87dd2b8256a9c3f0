"""FlashInfer paged attention for CUDA, behind the same plan/run interface as the torch backend.

``flashinfer`` is imported lazily so importing ``mstar.kernels`` on a CPU machine without it
works. The backend is built for one dtype (bf16 or fp16: FlashInfer has no float32 kernels, so
asking for float32 raises instead of silently running something else), which lets ``plan`` run
FlashInfer's own plan at once, once per step, from the KV plan's int32 CPU arrays.

Two kinds of wrapper, all over buffers that live as long as the backend:

- `FlashInferPagedAttention`: the eager path. All-decode steps take the decode wrapper (kernels
  tuned for one query per row); any other step the prefill wrapper, whose causal mask is aligned
  to each sequence's last token, so mixed prefill/decode batches are one call.
- `FlashInferGraphDecode`: one per CUDA-graph (bucket, slot). A decode wrapper in FlashInfer's
  CUDA-graph mode over fixed index buffers sized for the bucket, so the addresses a captured graph
  recorded stay valid and each replay only re-plans into them.

Every wrapper uses FlashInfer's FA2 kernels: the decode wrapper's tensor-core path and the
prefill wrapper then share one JIT module, where ``auto`` would pick FA3 for prefill on Hopper
and double the on-device compile (SGLang pins FA2 for the same reason); switching is left for a
measurement on the GPU. They also share one float workspace, sized at the first plan from the
model's heads and the largest graph bucket (`flashinfer_workspace`). Each wrapper stages its
plan arrays in page-locked memory and re-plans only once the device has read the last ones
(`plan_staging`), so no decode step makes a pageable copy of its metadata.

Every ``plan`` runs with inference mode off, whatever mode its caller is in. FlashInfer's plan
allocates buffers lazily (the workspace and wrappers at the first plan, a longer ``kv_lens``
buffer when a step has more rows) and writes into them at every later plan; a buffer made under
inference mode (graph capture plans its padding steps there) is an inference tensor, which a
later plan outside it may not write. The first H200 run failed every graph-on engine that way.

``runs`` counts kernel calls, so a test can prove FlashInfer really served a step.

``deterministic`` (``--deterministic``): every plan passes ``disable_split_kv=True``, so each
(request, head) reduces its keys in one pass whose order does not depend on how many requests
share the step (with split-KV the split count, and so the merge order, follows the batch).
Unverified on a GPU here. What it leaves batch-dependent: the prefill and decode wrappers are
different kernels (a position recomputed in a prompt chunk is not bit-identical to its decode),
and the prefill kernel's query tile follows the step's average query length.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch

from mstar.kernels.flashinfer_sinks import run_with_sinks
from mstar.kernels.flashinfer_workspace import workspace_bytes
from mstar.kernels.paged_layout import validate_plan
from mstar.kernels.plan_staging import Event, HostPlan, PlanStaging

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
#: FlashInfer's attention kernels for every wrapper (see the module docstring).
FA_BACKEND = "fa2"

Shape = tuple[int, int, int]  # (num_qo_heads, num_kv_heads, head_dim)


def flashinfer_available() -> bool:
    """True when the ``flashinfer`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def check_flashinfer_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"FlashInfer attention has no {dtype} kernels (bfloat16 and float16 only); "
            "use --attention-backend torch or --dtype bfloat16"
        )


def _checked(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's CSR arrays, validated, as int32 host tensors (what FlashInfer's plan reads)."""
    validate_plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
    parts = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    qo, kvp, idx, last = (p.to(device="cpu", dtype=torch.int32) for p in parts)
    return qo, kvp, idx, last


def check_split_kv_option(flashinfer: Any) -> None:
    """ValueError unless both wrappers' ``plan`` take ``disable_split_kv`` (FlashInfer 0.3+)."""
    for wrapper in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"):
        params = inspect.signature(getattr(flashinfer, wrapper).plan).parameters
        if "disable_split_kv" not in params:
            raise ValueError(
                f"--deterministic: this flashinfer's {wrapper}.plan has no disable_split_kv "
                "(FlashInfer 0.3 or later has it)"
            )


def _all_decode(qo_indptr: torch.Tensor) -> bool:
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    return bool(q_lens.numel()) and bool((q_lens == 1).all())


class FlashInferPagedAttention:
    """Eager paged attention through FlashInfer's batch prefill / decode wrappers (NHD).

    ``num_sms`` (default: the device's) sizes the workspace; ``new_event`` (default
    `torch.cuda.Event`) makes the events that order re-plans after the last plan's copies.
    """

    def __init__(
        self,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        *,
        num_sms: int | None = None,
        new_event: Callable[[], Event] | None = None,
        deterministic: bool = False,
    ) -> None:
        check_flashinfer_dtype(dtype)
        import flashinfer  # lazy: CUDA-only dependency

        self.flashinfer: Any = flashinfer
        if deterministic:
            check_split_kv_option(flashinfer)
        #: extra plan arguments (``disable_split_kv`` in deterministic mode)
        self.plan_options: dict[str, Any] = {"disable_split_kv": True} if deterministic else {}
        self.device = torch.device(device)
        self.dtype = dtype
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = num_sms
        self.new_event = new_event
        self._shape: Shape | None = None
        self._workspace: torch.Tensor | None = None
        self._graph_max_bs = 0
        self._prefill: Any = None
        self._decode: Any = None
        #: sliding window -> its own (prefill, decode) wrappers over the shared workspace
        #: (FlashInfer takes the window at plan time); window 0 is the pair above
        self._windowed: dict[int, tuple[Any, Any]] = {}
        self._staging = {
            "prefill": PlanStaging(self.device, new_event),
            "decode": PlanStaging(self.device, new_event),
        }
        #: this step's planned wrapper per window (0: full layers)
        self._wrappers: dict[int, Any] = {}
        self._num_tokens = 0
        #: Device copy of the step's page indices, reused (grown, never shrunk) step to step.
        self._indices = torch.zeros(1024, dtype=torch.int32, device=self.device)
        self.runs = 0
        self.plans = 0

    @property
    def workspace_bytes(self) -> int:
        """The shared float workspace's size (0 before the first plan)."""
        return 0 if self._workspace is None else self._workspace.numel()

    def staging(self, name: str) -> PlanStaging:
        """The eager ``prefill`` or ``decode`` wrapper's staging (tests read ``waits``)."""
        return self._staging[name]

    def workspace(self, shape: Shape) -> torch.Tensor:
        """The float workspace every wrapper shares, made (and the eager wrappers with it) at
        the first plan, when the model's heads are known; one backend serves one model."""
        if self._workspace is None:
            hq, hkv, d = shape
            size = workspace_bytes(hq, hkv, d, self.num_sms, self._graph_max_bs)
            self._workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
            fi = self.flashinfer
            self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=FA_BACKEND
            )
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=True, backend=FA_BACKEND
            )
            self._shape = shape
        elif shape != self._shape:
            raise ValueError(
                f"planned for (q heads, kv heads, head dim) {self._shape}, got {shape}"
            )
        return self._workspace

    def _device_indices(self, host: torch.Tensor) -> torch.Tensor:
        n = host.numel()
        if n > self._indices.numel():
            self._indices = torch.zeros(2 * n, dtype=torch.int32, device=self.device)
        view = self._indices[:n]
        view.copy_(host, non_blocking=True)
        return view

    @torch.inference_mode(False)
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
        sm_scale: float | None = None,
        windows: frozenset[int] = frozenset(),
    ) -> None:
        """FlashInfer's plan for this step, once (once per sliding window in ``windows``);
        every layer's ``run`` reuses it. ``sm_scale``: default ``head_dim ** -0.5``."""
        arrays = _checked(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        self.workspace((num_qo_heads, num_kv_heads, head_dim))
        decode = _all_decode(arrays[0])
        staging = self._staging["decode" if decode else "prefill"]
        host = staging.stage(*arrays)
        indices = self._device_indices(host.kv_indices)
        self._wrappers = {}
        for window in windows | {0}:
            # FlashInfer's window_left counts the keys before the query's own (-1: none).
            options = dict(q_data_type=self.dtype, kv_data_type=self.dtype,
                           sm_scale=sm_scale, window_left=window - 1 if window else -1)  # fmt: skip
            prefill, dec = self._pair(window)
            self._wrappers[window] = self._plan_one(
                prefill, dec, decode, host, indices, options,
                num_qo_heads, num_kv_heads, head_dim, page_size, causal,
            )  # fmt: skip
        staging.queued()
        self._num_tokens = int(host.qo_indptr[-1]) if host.qo_indptr.numel() else 0
        self.plans += 1

    def _pair(self, window: int) -> tuple[Any, Any]:
        """The (prefill, decode) wrappers of one window, made at its first plan."""
        if not window:
            return self._prefill, self._decode
        if window not in self._windowed:
            fi, ws = self.flashinfer, self._workspace
            self._windowed[window] = (
                fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=FA_BACKEND),
                fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=True, backend=FA_BACKEND
                ),
            )
        return self._windowed[window]

    def _plan_one(
        self,
        prefill: Any,
        dec: Any,
        decode: bool,
        host: HostPlan,
        indices: torch.Tensor,
        kinds: dict[str, Any],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
    ) -> Any:
        """Plan one window's wrapper for this step; returns it."""
        if decode:
            dec.plan(
                host.kv_indptr,
                indices,
                host.last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                pos_encoding_mode="NONE",
                **kinds,
                **self.plan_options,
            )
            return dec
        else:
            prefill.plan(
                host.qo_indptr,
                host.kv_indptr,
                indices,
                host.last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=causal,
                **kinds,
                **self.plan_options,
            )
            return prefill

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for q [T, Hq, D] against one layer's NHD cache view (``window``: a
        sliding-window layer's, planned in this step's ``windows``); ``sinks`` [Hq] (gpt-oss)
        rescale the output by the wrapper's log-sum-exp (`flashinfer_sinks`)."""
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned for {self._num_tokens} query rows, got {q.shape[0]}")
        wrapper = self._wrappers.get(window)
        if wrapper is None:
            raise RuntimeError(f"FlashInfer run before plan (of window {window})")
        self.runs += 1
        if sinks is not None:
            return run_with_sinks(wrapper, q, kv_layer, sinks)
        out: torch.Tensor = wrapper.run(q, kv_layer)
        return out

    def graph_decode(self, batch_size: int, max_pages: int) -> FlashInferGraphDecode:
        """A CUDA-graph decode wrapper for one (bucket, slot): ``batch_size`` rows exactly.

        Every bucket must be made before the first plan sizes the shared workspace.
        """
        if self._workspace is not None and batch_size > self._graph_max_bs:
            raise RuntimeError(
                f"graph bucket {batch_size} added after the FlashInfer workspace was sized for "
                f"buckets up to {self._graph_max_bs}"
            )
        self._graph_max_bs = max(self._graph_max_bs, batch_size)
        return FlashInferGraphDecode(self, batch_size, max_pages)


class FlashInferGraphDecode:
    """Decode wrapper in CUDA-graph mode: fixed buffers, ``batch_size`` rows every plan."""

    def __init__(self, parent: FlashInferPagedAttention, batch_size: int, max_pages: int) -> None:
        self.parent = parent
        self.device = parent.device
        self.dtype = parent.dtype
        self.batch_size = batch_size
        i32 = torch.int32
        self._indptr = torch.zeros(batch_size + 1, dtype=i32, device=self.device)
        self._indices = torch.zeros(max(1, max_pages), dtype=i32, device=self.device)
        self._last = torch.zeros(batch_size, dtype=i32, device=self.device)
        self._staging = PlanStaging(self.device, parent.new_event)
        self._wrapper: Any = None
        self.runs = 0
        self.plans = 0

    @property
    def staging(self) -> PlanStaging:
        return self._staging

    def _ensure_wrapper(self, shape: Shape) -> Any:
        if self._wrapper is None:
            self._wrapper = self.parent.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.parent.workspace(shape),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._indptr,
                paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=self._last,
                backend=FA_BACKEND,
            )
        return self._wrapper

    @torch.inference_mode(False)
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
        sm_scale: float | None = None,
        windows: frozenset[int] = frozenset(),
    ) -> None:
        if any(windows):
            raise ValueError("CUDA-graph decode does not run sliding-window layers")
        arrays = _checked(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
        rows = arrays[1].numel() - 1
        if rows != self.batch_size or not _all_decode(arrays[0]):
            raise ValueError(
                f"graph decode wrapper takes exactly {self.batch_size} one-token rows, got {rows}"
            )
        if arrays[2].numel() > self._indices.numel():
            raise ValueError("more KV pages than the graph wrapper's index buffer holds")
        wrapper = self._ensure_wrapper((num_qo_heads, num_kv_heads, head_dim))
        host: HostPlan = self._staging.stage(*arrays)
        indices = self._indices[: host.kv_indices.numel()]
        indices.copy_(host.kv_indices, non_blocking=True)
        wrapper.plan(
            host.kv_indptr,
            indices,
            host.last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode="NONE",
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=sm_scale,
            **self.parent.plan_options,
        )
        self._staging.queued()
        self.plans += 1

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._wrapper is None:
            raise RuntimeError("FlashInfer graph decode run before its first plan")
        if window:
            raise ValueError("CUDA-graph decode does not run sliding-window layers")
        self.runs += 1
        if sinks is not None:
            return run_with_sinks(self._wrapper, q, kv_layer, sinks)
        out: torch.Tensor = self._wrapper.run(q, kv_layer)
        return out
